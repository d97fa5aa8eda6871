"""mambaserve: serving Mamba2 and hybrid state-space language models."""
