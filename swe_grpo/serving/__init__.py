"""The agent-facing model server: the InterceptionServer and its routes (`interception`), the OpenAI wire
format (`openai_wire`), the limits that keep one rollout from starving the others (`limits`), the vLLM
client (`vllm_client`) and the unix-socket door from a sandbox to the server (`door`)."""
