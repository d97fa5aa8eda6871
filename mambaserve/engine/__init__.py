"""The engine: sequences, scheduler, model runner, graph runners, sampler, input and output
processing, and the step loop (`llm_engine`); the engine's command-line flags (`arg_utils`)."""
