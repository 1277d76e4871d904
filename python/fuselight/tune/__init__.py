"""Tuning: measure kernel variants on the GPU and turn the timings into the configs the rules read."""
