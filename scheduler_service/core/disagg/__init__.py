"""Prefill/decode disaggregation, the scheduler core's half (SGLang's
disaggregation/prefill.py and decode.py queues): a prefill unit computes a
prompt and sends its KV pages to a decode unit, which decodes it as if it
had prefilled it itself. docs/design.md, section 3, "Prefill/decode
disaggregation (core)", has the states, the orders and every failure path.
"""
