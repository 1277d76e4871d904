"""fuselight's own versions of the MLC-LLM compiler passes the baseline pipeline uses.

The baseline pipeline runs MLC-LLM's pass objects when MLC-LLM is importable and these otherwise;
each module mirrors one MLC pass (its docstring names it) for a model (float or 4-bit group-quantized
weights) without sampling functions or pipeline parallelism. ``fuselight.pipeline.BASELINE_PASSES`` lists them.
"""
