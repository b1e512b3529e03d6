"""The FSDP training ranks: worker, policy, critic, forward, optimizer, checkpoints, memory."""
