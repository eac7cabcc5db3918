%% The settings in force and the lane table, read by every sender from
%% persistent_term (written only by convoy_control). The key is an atom: every
%% remote send looks it up, and an atom hashes and compares at once where a
%% tuple is walked twice.
%%
%% A field named after a setting (every key of convoy_config:settings/0 but
%% `lanes') is filled from the configuration by convoy_control's runtime/3; the
%% other fields are set there by name.
-define(RUNTIME_KEY, '$convoy_runtime').

-record(runtime, {
    %% a node's runtime (`convoy_lanes'): its lanes' pids, index 1..n; the
    %% settings' runtime: none
    lanes :: tuple(),
    %% the settings' runtime: each connected node's runtime (a node's: none)
    rows :: #{node() => #runtime{}},
    %% this start of convoy (tells stale caches): an integer, compared on every
    %% cached lookup of a send at the cost of one word
    generation :: pos_integer(),
    %% lanes per node (the `lanes' setting)
    n :: pos_integer(),
    %% a node's runtime: its lanes' admission counters (convoy_slots), index 1..n
    slots :: tuple(),
    %% the clock of the lanes' bookkeeping (convoy_slots:now_us/1): ticks of
    %% os:perf_counter/0 per microsecond, 0 for erlang:monotonic_time/1
    clock :: non_neg_integer(),
    %% true once convoy is stopping (false as published at start): the lanes are
    %% closed and drain; a sender with messages in its lane waits for the lane to
    %% finish, then sends plainly
    stopping :: boolean(),
    bypass_after :: non_neg_integer() | never,
    max_buffered :: pos_integer() | infinity,
    max_buffered_bytes :: pos_integer() | infinity,
    overload :: block | drop | error,
    block_timeout :: non_neg_integer(),
    %% what a refused message becomes: send/2 drops it (counted, the value
    %% published), send/3 returns {error, overload}; set per call, not a setting
    refuse :: drop | error,
    max_batch :: pos_integer(),
    max_delay :: non_neg_integer(),
    large_threshold :: non_neg_integer() | infinity,
    %% messages sent in pieces (convoy_chunk)
    chunk_threshold :: non_neg_integer() | infinity,
    chunk_bytes :: pos_integer(),
    chunk_window :: pos_integer(),
    chunk_guard :: non_neg_integer() | always,
    max_reassembly_bytes :: pos_integer() | infinity,
    barrier_timeout :: non_neg_integer(),
    telemetry :: boolean(),
    %% the zlib level a lane compresses its batches with (convoy_compress), or
    %% `auto' (convoy_compress_auto)
    compress :: never | auto | 1..9,
    config :: map()
}).
