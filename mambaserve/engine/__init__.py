"""The engine: sequences, scheduler, forward context, model runner, sampler, input and output
processing, and the step loop (`llm_engine`)."""
