"""Core ML ML Programs (MIL) on any OS: the numpy reference executor and `.mlpackage` metadata.

The runtime runs a saved draft package with it where Core ML is unavailable (`reference` draft
backend), and the converter checks what it wrote with it; nothing here imports the converter.
`interpreter` compiles and runs a program's function, `math_ops` and `shape_ops` are its op
kernels, `numerics` how they compute, `constants` the weights they share, and `package` reads a
saved package's program and the draft description stored in its metadata.
"""
