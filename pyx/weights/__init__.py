"""The packed weight formats the backends compute on, as the model graph holds them in place of
a float (N, K) matrix (each has `.shape`): ggml blocks (ggml.py: GGUF files, --isq), FP8 codes
with block scales (fp8.py), int4 codes with group scales (int4.py: GPTQ, AWQ,
compressed-tensors, --isq marlin) and the Marlin layout the CUDA backend repacks int4 to
(marlin.py). The loaders in engine/ build them; pyx/cpu_backend.pyx and pyx/cuda_backend.pyx
recognise them with isinstance. Pure Python over NumPy: nothing here imports a backend.
"""
