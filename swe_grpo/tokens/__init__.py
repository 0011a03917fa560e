"""Messages <-> exact token ids: OpenAI message normalisation and comparison (`messages`), the training chat
template (`template`), the per-rollout token chain (`chain`), and the parsing of a completion into an assistant
message (`responses`). Nothing here imports `swe_grpo.serving`."""
