"""The agent-facing model server: the InterceptionServer, its routes and rollouts (`interception`), one rollout's
state and record (`session`), the turn transaction (`turn`), the OpenAI wire format (`openai_wire`), the limits
that keep one rollout from starving the others (`limits`) and the vLLM client (`vllm_client`). It may import
`swe_grpo.tokens` and `swe_grpo.types`, nothing above: it knows no sandbox, and serves a sandbox's door
(`swe_grpo.sandbox.door`) as the unix socket path it is handed."""
