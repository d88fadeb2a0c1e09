"""Tools around the decoding engine, outside its hot path: the CUDA step's kernel count on a CPU
(kernel_count), the machine's roofline floor for a step (roofline), the exact and 8-bit modes
side by side (modes), and transformers' own greedy / sampling as a baseline (baselines). They
import the engine (jacobi_ext.decoding); the engine imports none of them."""
