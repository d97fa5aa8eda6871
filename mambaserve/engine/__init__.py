"""The engine: sequences, scheduler, forward context, model runner, sampler and the step loop."""
