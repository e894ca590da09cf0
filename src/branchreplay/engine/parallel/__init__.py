"""The execution stack over several ranks: `sharding` (which rank runs which trees, or a long shared prefix split
across them, by a cost model), `distributed` (FSDP2 gathered once or per layer, DDP, and the gradient reduced once),
`context_parallel` (a shared prefix computed once across the ranks, its K/V all-gathered per layer) and `lockstep`
(the ranks' packs in step where FSDP2 gathers each layer per pack)."""
