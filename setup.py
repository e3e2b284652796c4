"""megatron-zb: zero-bubble pipeline parallelism for megatron-core."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-zb",
    version="0.1.0",
    description="Zero-bubble pipeline parallelism (ZB-H1/H2, greedy ZB, ZB-V) for megatron-core",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zb", "megatron_zb.*"]),
    # Install `torch==2.13.0` (or your CUDA build) *before* this package: an unpinned torch
    # requirement would pull a multi-GB CUDA wheel on a CPU machine.
    install_requires=[
        "torch>=2.6",
        # 0.16.1 (Python >= 3.10) or 0.19.x (Python >= 3.12), each tested (docs/compatibility.md); 0.17 and
        # 0.18 are untested and refused at run time (megatron_compat.release)
        "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",
        "numpy",
        "matplotlib",
        "psutil",   # megatron-core's async checkpoint writer hangs without it
        "ortools>=9.10",  # exact schedule solver (CP-SAT)
        # tokenizers read from local files (docs/training.md "Tokenizers"); small wheels, checked with
        # `pip download --no-deps` for CPython 3.11 x86-64: sentencepiece 0.2.3 1.7 MB (no dependencies),
        # tiktoken 0.14.0 1.2 MB (+ regex, requests), regex 0.8 MB
        "sentencepiece",  # GPTSentencePieceTokenizer, Llama2Tokenizer (through megatron-core's wrapper)
        "tiktoken",  # TikTokenizer (through megatron-core's wrapper)
        "regex",  # GPT2BPETokenizer's pre-tokenization pattern (Unicode classes)
    ],
    extras_require={
        # transformers: the HuggingFaceTokenizer tests (tests/training/test_tokenizers.py);
        # pyyaml, pydantic, six (and regex, a default dependency): imported at top level by Megatron-LM's
        # training package, which tests/megatron_lm/test_megatron_lm_loop.py runs (tests/harness/megatron_lm.py)
        # and tests/training/test_tokenizers_vs_megatron_lm.py imports; not needed otherwise
        "test": ["pytest>=8", "hypothesis>=6", "transformers", "pyyaml", "pydantic", "six"],
        # GPU only: fused wgrad_gemm_accum kernels and TE layers. Neither runs on a CPU machine;
        # apex is not on PyPI (the "apex" there is an unrelated project): build NVIDIA apex from
        # source with --cpp_ext --cuda_ext.
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megatron-zb=megatron_zb.cli:main"]},
)
