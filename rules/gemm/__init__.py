"""Tensor-core GEMM templates for matmuls whose M (tokens) is only known at run time.

``operands`` says what a template computes (the contract between the Matmul rule's analysis and
the templates); the templates write a kernel body over the analysed function's own buffers, so the
rule keeps the function's signature and any fused epilogue.
"""
