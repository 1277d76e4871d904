from . import pipeline  # noqa: F401  (registers "mlc_llm", as MLC's compiler_pass package does)
