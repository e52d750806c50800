"""Sources and shared readers: corpora, model assets, the audited tables, embeddings, held-out scoring."""
