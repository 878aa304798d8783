"""The update's kernels: log-probs and the fused head, padding, precision, FLOP rate of the K passes."""
