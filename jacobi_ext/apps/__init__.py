"""The applications built on the library: the `jacobi-forcing` command line (`cli`, `cli_args`),
the demo (`demo`), the benchmark report and its figures (`report`, `plots`). Nothing below this
folder imports it."""
