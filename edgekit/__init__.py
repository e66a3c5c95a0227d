"""edgekit: compress, compile and serve vision-language report models on edge devices."""

__version__ = "0.1.0"
