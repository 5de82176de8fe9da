"""GPU kernels of the fast path (Triton, PTX), each registered as a torch custom op with a torch reference for CPU."""
