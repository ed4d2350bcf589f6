"""Correctness checks run where the tests cannot: on the GPU machine (golden tokens and determinism
against transformers, bf16 error against float32, the device-side features) and an offline compile of
the Triton kernels for sm_90a without a GPU."""
