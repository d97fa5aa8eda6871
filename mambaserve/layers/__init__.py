"""Model building blocks over packed token batches: Mamba2 mixer, attention, MoE, MLP, norms."""
