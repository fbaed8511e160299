"""Prefill/decode disaggregation: a prompt's KV blocks computed on one worker, decoded on
another, handed over by a gateway (SMG's PD mode, vLLM's sequential protocol).

    client -> SMG --(1) Generate, max_tokens 1, kv_transfer_params_json
                        {"do_remote_decode": true}-------------------------> prefill worker
                  <-(2) GenerateComplete.kv_transfer_params_json: the handoff   computes the
                                                                              prompt, pins
                                                                              its blocks
              --(3) the client's request + the handoff, verbatim ---------> decode worker
                                                     (4) KVTransfer.PullBlocks
                                           decode worker ----------------> prefill worker
                                           blocks written into its cache, marked computed;
                                           it computes the last prompt token and decodes

`handoff`   the JSON both ways: parsed strictly (bounded, typed), vLLM NIXL's keys where
            they mean the same, ours under ``llm_worker`` (the handle, the layout facts)
`blocks`    reading and writing a cache's blocks as bytes, in its dtype and layout
`service`   the prefill side's gRPC service (llmworker.v1.KVTransfer), on the main port
`client`    the decode side's pulls, on their own threads (never the engine's)
`stats`     the figures: Prometheus, GetServerStatus

SMG drives this protocol for a vLLM-protocol worker only when its GetServerInfo names the
connector NixlConnector, so that is what we report (see `SMG_CONNECTOR`), while the blocks
travel over our own gRPC service; the handoff carries our key, so a real NIXL worker's
handoff reaching us is computed locally (counted), never misread.
"""
