"""The kernels' Python side: loading the compiled operators (`_native`), their fake kernels and
autograd (`ops`), the block-causal attention and its backend choice (`attention`,
`_attn_streams`) and the token layouts it runs on (`layout`). Everything above this folder
reaches `torch.ops.jacobi_ext.*` through here."""
