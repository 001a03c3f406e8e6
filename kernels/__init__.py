"""Compute kernels. Each op has a torch reference (the CPU path and the test oracle);
triton versions sit beside them and are selected on CUDA only."""
