"""Rollouts from a vLLM server: the client (`client`: generation, weight sync, its errors), branching schedules as
requests (`sampling`), the server as its own process group (`server_process`), and the weights file a sync writes
(`weights_file`)."""
