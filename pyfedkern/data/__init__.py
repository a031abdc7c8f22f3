"""Data for experiments: datasets (bundled digits and synthetic(α, β), MNIST/CIFAR-10 from the user's files) and
client partitions. Used by the algorithms' callers and the simulator; imports nothing above the ops."""
