"""Messages <-> exact token ids: the training chat template and the per-rollout token chain (`chain`),
and the parsing of a completion into an assistant message (`responses`)."""
