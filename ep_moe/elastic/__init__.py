"""DeepEP's V2 buffer and the services it serves (`ep_moe.ElasticBuffer` is the public name of
`elastic_buffer.ElasticBuffer`).

Modules, bottom to top: `wire_format` (PP/AGRS headers: dtype codes, byte views, slot rounding), `peer_wait`
(waits with a deadline that name the rank and stage), `transport_choice` (torch or native transport for PP/AGRS);
`memory` (the symmetric memory types); `engram` (Engram tables), `pipeline_comm` (PP), `agrs` (AGRS sessions);
`elastic_buffer` (`ElasticBuffer`, `ElasticHandle`). This file imports nothing: `ep_moe.native` imports
`memory` without loading `ElasticBuffer`.
"""
