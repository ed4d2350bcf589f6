"""Process groups and how a model splits over them.

    rank_group.py       the torch.distributed group of a rank group (gloo on the CPU, NCCL on CUDA)
    tensor_parallel.py  --tp N: TensorGroup (all-reduce, vocabulary gather) and TpShard (who holds which rows)
    expert_parallel.py  --ep N: ExpertGroup (the all-to-all of a MoE layer's tokens)
    world.py            the process world of --dp D --tp N --ep D*N, joined and left as one
"""
