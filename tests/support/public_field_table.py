"""Every field of every public request message and what it does
(public_fields.py says the row kinds). tests/scheduler_service/api/
test_public_field_conformance.py fails while a field of the proto has no row
(or a row names a field that is gone); tests/e2e/test_public_field_effects.py
runs the Here and Refused rows against real servers.

A field whose effect a branch in flight is building may have a ``Pending``
row (or an owned refusal) naming that branch in ``PENDING_OWNERS``; none is
pending today."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from tests.support import public_field_checks as c
from tests.support.public_fields import Elsewhere, Here, Refused, Row

# Branches in flight whose fields may still be Pending or owned refusals.
PENDING_OWNERS: frozenset[str] = frozenset()

INVALID = "INVALID_ARGUMENT"
PD_GRPC = "tests/e2e/test_pd_gateway.py::test_prompt_and_output_logprobs_over_grpc_equal_colocated"
SMOLLM2 = "tests/e2e/test_smollm2_system.py"
STRUCTURED_SIM = "tests/e2e/test_structured_simulated.py"
STRUCTURED_REAL = "tests/e2e/test_structured_real.py"
LORA_SIM = "tests/e2e/test_lora_simulated.py::test_load_generate_mixed_adapters_and_unload"
SP = "GenerateRequest.sampling_params"


def _set(path: str, value: object):
    """A setter of the field at ``path`` (below the request) to ``value``."""

    def apply(request) -> None:
        msg = request
        *parents, name = path.split(".")[1:]
        for p in parents:
            msg = getattr(msg, p)
        if isinstance(value, Timestamp):
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)

    return apply


FIELDS: dict[str, Row] = {
    # ------------------------------------------------------- GenerateRequest
    "GenerateRequest.request_id": Here(c.request_id),
    "GenerateRequest.tokenized.input_ids": Here(c.input_ids),
    "GenerateRequest.tokenized.original_text": Elsewhere(
        "tests/e2e/test_serve_options.py::test_original_text_is_tokenized_by_the_server",
        "tokenized by the server's tokenizer, the same output as its ids",
    ),
    "GenerateRequest.mm_inputs": Refused(INVALID, "multimodal inputs", whole=True),
    "GenerateRequest.return_logprob": Here(c.return_logprob),
    "GenerateRequest.logprob_start_len": Elsewhere(
        f"{SMOLLM2}::test_output_and_prompt_logprobs_match_transformers",
        "prompt logprobs from that position, equal to transformers'",
    ),
    "GenerateRequest.top_logprobs_num": Elsewhere(
        f"{SMOLLM2}::test_output_and_prompt_logprobs_match_transformers",
        "the top-n logprobs per position, equal to transformers'",
    ),
    "GenerateRequest.token_ids_logprob": Here(c.token_ids_logprob, model="default"),
    "GenerateRequest.return_hidden_states": Refused(INVALID, "hidden states"),
    "GenerateRequest.disaggregated_params.bootstrap_host": Elsewhere(
        PD_GRPC,
        "the decode unit claims the room at this host (the prefill unit's); a unit that is "
        "not disaggregated refuses disaggregated_params by name (test_simulated_system.py)",
    ),
    "GenerateRequest.disaggregated_params.bootstrap_port": Elsewhere(
        PD_GRPC, "... and port (the prefill unit's --disaggregation-bootstrap-port)"
    ),
    "GenerateRequest.disaggregated_params.bootstrap_room": Elsewhere(
        PD_GRPC, "the room both units key the transfer by (sample i of n: room + i * 2**31)"
    ),
    "GenerateRequest.custom_logit_processor": Refused(INVALID, "custom_logit_processor"),
    "GenerateRequest.timestamp": Refused(
        INVALID, "timestamp", _set("GenerateRequest.timestamp", Timestamp(seconds=1))
    ),
    "GenerateRequest.log_metrics": Here(c.log_metrics),
    "GenerateRequest.input_embeds": Refused(INVALID, "input embeddings"),
    "GenerateRequest.lora_id": Elsewhere(
        LORA_SIM, "each adapter its own simulated model; an unknown id refused by name"
    ),
    "GenerateRequest.data_parallel_rank": Here(c.data_parallel_rank),
    "GenerateRequest.stream": Here(c.stream),
    "GenerateRequest.require_reasoning": Elsewhere(
        "tests/e2e/test_reasoning_gateway.py::test_the_grammar_waits_for_the_end_of_the_thought",
        "the grammar applies after </think>, reasoning_tokens counted; refused by name for a "
        "model without the token (tests/scheduler_service/api/test_require_reasoning.py)",
    ),
    # ------------------------------------------------------- SamplingParams
    f"{SP}.temperature": Here(c.temperature, model="default"),
    f"{SP}.top_p": Here(c.top_p, model="default"),
    f"{SP}.top_k": Here(c.top_k, model="default"),
    f"{SP}.min_p": Here(c.min_p, model="default"),
    f"{SP}.frequency_penalty": Here(c.frequency_penalty, model="default"),
    f"{SP}.presence_penalty": Here(c.presence_penalty, model="default"),
    f"{SP}.repetition_penalty": Here(c.repetition_penalty, model="default"),
    f"{SP}.max_new_tokens": Here(c.max_new_tokens),
    f"{SP}.stop": Elsewhere(
        f"{SMOLLM2}::test_stop_tokens_and_stop_strings",
        "ends at a stop string in the detokenized output, decoded with special tokens, "
        "streamed text held back while it may become one (test_stop_strings_simulated.py)",
    ),
    f"{SP}.stop_token_ids": Here(c.stop_token_ids),
    f"{SP}.skip_special_tokens": Elsewhere(
        "tests/scheduler_service/engine/test_stop_string_matcher.py::"
        "test_a_special_token_stop_string_matches_whatever_skip_special_tokens_says",
        "the client's text only (as SGLang's gRPC path); the stop-string check decodes with "
        "special tokens whatever it says",
    ),
    f"{SP}.spaces_between_special_tokens": Here(
        c.same_ids_whatever_it_says("spaces_between_special_tokens")
    ),
    f"{SP}.regex": Elsewhere(
        f"{STRUCTURED_SIM}::test_every_output_fully_matches_its_regex", "outputs match the regex"
    ),
    f"{SP}.json_schema": Elsewhere(
        f"{STRUCTURED_SIM}::test_every_completed_output_validates_against_its_schema",
        "outputs validate against the schema",
    ),
    f"{SP}.ebnf_grammar": Elsewhere(
        f"{STRUCTURED_REAL}::test_regex_ebnf_and_structural_tag", "outputs parse by the grammar"
    ),
    f"{SP}.structural_tag": Elsewhere(
        f"{STRUCTURED_REAL}::test_regex_ebnf_and_structural_tag", "tagged sections follow schemas"
    ),
    f"{SP}.n": Here(c.n),
    f"{SP}.min_new_tokens": Here(c.min_new_tokens),
    f"{SP}.ignore_eos": Here(c.ignore_eos),
    f"{SP}.no_stop_trim": Elsewhere(
        "tests/e2e/test_clients.py::test_stop_strings_are_trimmed_unless_asked_not_to",
        "the client keeps the stop string in its text; the server's ids run through the "
        "stop either way (as SGLang's gRPC path)",
    ),
    f"{SP}.stream_interval": Elsewhere(
        "tests/e2e/test_stop_strings_simulated.py::test_stream_interval_sends_the_first_token_at_once",
        "a chunk at the first token, then every N tokens (SGLang's rule)",
    ),
    f"{SP}.logit_bias": Here(c.logit_bias, model="default"),
    f"{SP}.custom_params": Here(c.custom_params, model="default"),
    # ------------------------------------------------------- the other RPCs
    "EmbedRequest.request_id": Here(c.embed_request_id),
    "EmbedRequest.tokenized.input_ids": Here(c.embed_input_ids),
    "EmbedRequest.tokenized.original_text": Here(c.embed_original_text),
    "EmbedRequest.mm_inputs": Refused(INVALID, "multimodal inputs", whole=True),
    "EmbedRequest.sampling_params": Here(c.embed_sampling_params, whole=True),
    "EmbedRequest.token_type_ids": Refused(INVALID, "token_type_ids"),
    "EmbedRequest.data_parallel_rank": Refused(INVALID, "data_parallel_rank"),
    "EmbedRequest.is_cross_encoder": Elsewhere(
        "tests/e2e/test_rerank_real.py::test_rerank_scores_equal_transformers",
        "a query/document pair scored by the model's score head, equal to transformers'; "
        "refused by name for a model without one (test_embeddings_simulated.py)",
    ),
    "EmbedRequest.texts": Elsewhere(
        "tests/scheduler_service/api/test_rerank_convert.py::"
        "test_the_pair_comes_from_texts_or_ready_tokenized",
        "[query, document] tokenized through the tokenizer's pair template",
    ),
    "AbortRequest.request_id": Here(c.abort_request_id),
    "AbortRequest.reason": Elsewhere(
        "tests/scheduler_service/api/test_abort_reason.py::"
        "test_the_abort_reason_reaches_the_core_as_the_requests_abort_message",
        "the message the core finishes the request with; the stream ends as SGLang's",
    ),
    "GetLoadsRequest.dp_rank": Here(c.get_loads_dp_rank),
    "GetLoadsRequest.include": Here(c.get_loads_include),
    "FlushCacheRequest.timeout_s": Elsewhere(
        "tests/scheduler_service/api/test_admin_rpcs.py::"
        "test_flush_cache_asks_the_core_again_until_it_is_idle_within_the_timeout",
        "asks the core again until it is idle, within the timeout; 0: once",
    ),
    "StartProfileRequest": Refused("UNIMPLEMENTED", "radixserve", whole=True),
    "SubscribeKvEventsRequest.start_sequence_number": Refused(
        "OUT_OF_RANGE", "resubscribe with zero"
    ),
    "SubscribeKvEventsRequest.load_records_before_first_batch": Here(
        c.load_records_before_first_batch
    ),
    "LoadLoRAAdapterRequest.lora_name": Elsewhere(LORA_SIM, "listed under its name"),
    "LoadLoRAAdapterRequest.lora_path": Elsewhere(LORA_SIM, "the adapter read from it"),
    "LoadLoRAAdapterRequest.pinned": Elsewhere(LORA_SIM, "keeps its slot"),
    "LoadLoRAAdapterRequest.lora_id": Elsewhere(LORA_SIM, "what requests name"),
    "UnloadLoRAAdapterRequest.lora_name": Elsewhere(LORA_SIM, "unloads by name"),
    "UnloadLoRAAdapterRequest.lora_id": Elsewhere(LORA_SIM, "unloads the adapter it names"),
}

WHOLE = frozenset(
    path for path, row in FIELDS.items() if isinstance(row, Refused | Here) and row.whole
)
