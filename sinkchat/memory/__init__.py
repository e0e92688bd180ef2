"""The recall memory: nothing leaves the attention-sink cache silently.

Tokens evicted from the window go, in blocks of B, to an append-only checksummed store on disk (`store.py`); each
block is indexed per layer and KV head by a few representative keys (`blocks.py`). Before each model call the last
token's queries score every block per layer (each query head's share among the blocks, summed: `index.py`), and
the top-k blocks' keys and values are copied, rotated to one position (InfLLM's rule: all memory at one
distance), into a region of slots the cache keeps in front of the stream (`SinkLayer.base`), which every path
(native step and prefill, transformers' forward) attends with the sinks and the window (`recall.py`). Past the disk budget the oldest blocks go, and that is a `ForgottenEvent`.
"""
