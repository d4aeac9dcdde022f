"""Quantized weights. A LinearMethod (kvserve/layers/linear.py's seam) per format; models never
mention quantization.

    gguf.py   GGUF block formats run as stored (Q4_1, Q8_0): the loader hands the blocks over,
              GGUFLinearMethod keeps them, the ops backends' linear reads them.
"""
