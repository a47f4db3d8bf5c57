"""Where parameters, gradients and optimizer state live, sharded or not: the flat ZeRO-1 state (zero1, acco,
dpu, wp), dim-0 shards on flat buffers and on PyTorch FSDP2 (fsdp, flexdemo), and the sharded optimizer under
them."""
