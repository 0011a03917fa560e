"""The agent-facing model server: the InterceptionServer, its routes and rollouts (`interception`), one rollout's
state and record (`session`), the turn transaction (`turn`), the OpenAI wire format (`openai_wire`), the limits
that keep one rollout from starving the others (`limits`), the vLLM client (`vllm_client`) and the unix-socket
door from a sandbox to the server (`door`). It may import `swe_grpo.tokens`, `swe_grpo.types` and
`swe_grpo.sandbox.base`, nothing above."""
