"""The engine: sequences, scheduler, forward context, model runner, sampler, input and output
processing, and the step loop (`llm_engine`); the engine's command-line flags (`arg_utils`)."""
