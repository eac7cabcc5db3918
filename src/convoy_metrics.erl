%% @private
%% Always-on counters and optional telemetry events.
%%
%% Per remote node: a `counters' array and a held array (`convoy_held') in the
%% node's row of the `convoy_nodes' table. `convoy_peers' owns the table and is its
%% only writer: it creates a row when someone first asks for the node's references
%% (`convoy_peers:refs/1') and forgets it once the node is gone and idle (see
%% `convoy_peers'). Node-independent rejections (bad input) live in one `atomics'
%% array so the first of each kind can be logged. Credit channels' waits are
%% counted node-wide here too (`convoy_channel' keeps the array).
%% Every telemetry event goes through `emit/4' or `event/3', so the `telemetry'
%% setting holds for all of them. Events are emitted per batch or per episode,
%% never per message, and only when the `telemetry' module is loaded: there is no
%% build dependency on it.
-module(convoy_metrics).

-export([init/0, lost/1, lost/0, new_refs/0, add/3, add_direct/1, close/1,
         unanswered/2, escalate/1, is_unanswered/1, may_wait_for_room/2, answered/1,
         node_info/1, node_counts/1, node_report/3, held/1, rejected/1, rejected/2, rejected/0,
         no_rejections/0, emit/4,
         event/3, new_waits/0, add_wait/2, waits/1]).

-export_type([counter/0, rejection/0]).

-include_lib("kernel/include/logger.hrl").
-include("convoy_runtime.hrl").

-define(REJECTED, {convoy, rejected}).
-define(LOST, {convoy, lost}).

-type counter() :: accepted | messages | batches | dropped | received | direct
                 | refused | blocked_us | chunked | stalled | waited_us
                 | compressed_batches | compressed_bytes_in | compressed_bytes_out.
-type rejection() :: bad_version | malformed_batch | bad_entry | bad_hello
                   | unknown_message | unknown_node | undeliverable | too_costly
                   | unsolicited | bad_piece | partial_discarded | reassembly_full
                   | bad_compressed.

-define(COUNTERS, [accepted, messages, batches, dropped, received, direct, refused,
                   blocked_us, chunked, stalled, waited_us, compressed_batches,
                   compressed_bytes_in, compressed_bytes_out]).
%% Beside the counters, the mark of a forgotten row (`close/1') and the node's
%% unanswered mark (`unanswered/2'), not counted among them.
-define(CLOSED_IX, (length(?COUNTERS) + 1)).
-define(UNANSWERED_IX, (length(?COUNTERS) + 2)).
%% When (monotonic ms) the node was marked after a wait for room ran out.
-define(MARKED_AT_IX, (length(?COUNTERS) + 3)).
-define(DIRECT_IX, 6).
-define(REJECTIONS, [bad_version, malformed_batch, bad_entry, bad_hello,
                     unknown_message, unknown_node, undeliverable, too_costly,
                     unsolicited, bad_piece, partial_discarded, reassembly_full,
                     bad_compressed]).

%% @doc Create the rejection counters (once per start of the application).
-spec init() -> ok.
init() ->
    persistent_term:put(?LOST, counters:new(1, [])),
    persistent_term:put(?REJECTED, atomics:new(length(?REJECTIONS), [{signed, false}])).

%% @doc Count messages lost with a lane that died (killed from outside, or a bug):
%% what it had been handed and had not disposed of. Not per node: the dead lane
%% took that breakdown with it.
-spec lost(non_neg_integer()) -> ok.
lost(N) ->
    counters:add(persistent_term:get(?LOST), 1, N).

%% @doc Messages lost with dead lanes since convoy started.
-spec lost() -> non_neg_integer().
lost() ->
    counters:get(persistent_term:get(?LOST), 1).

%% @doc Fresh references: for a new row (`convoy_peers'), or for a process that
%% must keep counting while `convoy_peers' is gone (counts nobody reads).
%%
%% No `write_concurrency' for the counters: it costs a cache line per scheduler per
%% row (224 bytes with 2 schedulers, 4,192 with 64, against 104) and buys little,
%% since counters change per batch (lanes, inboxes) and, per message, only on a
%% sender's direct send, which an idle and quiet lane rations; senders already share
%% the node's held atomics on every message they hand to a lane.
-spec new_refs() -> {counters:counters_ref(), convoy_held:held()}.
new_refs() ->
    {counters:new(?MARKED_AT_IX, []), convoy_held:new()}.

%% @doc Mark a forgotten row's counters (`convoy_peers', once its held array is
%% closed): a sender's cached copy stops counting there (`add_direct/1').
-spec close(counters:counters_ref()) -> ok.
close(Ref) ->
    counters:put(Ref, ?CLOSED_IX, 1).

%% @doc Mark the node as not answering: a sender's wait for its answer (a
%% barrier, its lane's drain, a piece) ran out (`wait'), or a sender blocked by
%% the node's bound (policy `block') for its whole `block_timeout' (`room'). Until
%% a lane clears the mark (`answered/1', once the node answers a barrier the lane
%% sends it), senders send to it only through their lanes, which hold and count
%% what waits: a stall costs each sender at most one wait. The caller asks its
%% lane to probe the node.
%%
%% The word holds 0 (answering), 1 (`wait'), 2 (`room': a block ran out) or 3 (a
%% block ran out and the node did not answer the lane's probe within
%% `barrier_timeout', see `escalate/1', or it had not answered since an earlier
%% wait ran out: senders at its bound stop waiting for room). A node held back
%% on purpose (`max_delay') answers the probe at once, so only a node that does
%% not answer makes `block' refuse at once.
-spec unanswered(counters:counters_ref(), wait | room) -> ok.
unanswered(Ref, Why) ->
    Before = counters:get(Ref, ?UNANSWERED_IX),
    Level = case {Why, Before} of
                {wait, _} -> 1;
                {room, 0} -> 2;
                {room, _} -> 3 % and it had not answered since an earlier wait ran out
            end,
    _ = Level =:= 2 andalso Before < 2
        andalso counters:put(Ref, ?MARKED_AT_IX, erlang:monotonic_time(millisecond)),
    _ = Before >= Level orelse counters:put(Ref, ?UNANSWERED_IX, Level),
    ok.

%% @doc A lane's probe went unanswered for `barrier_timeout': a node marked after
%% a block ran out (`room') now refuses senders at its bound at once.
-spec escalate(counters:counters_ref()) -> ok.
escalate(Ref) ->
    case counters:get(Ref, ?UNANSWERED_IX) of
        2 -> counters:put(Ref, ?UNANSWERED_IX, 3);
        _ -> ok
    end.

%% @doc Whether the node is marked as not answering (`unanswered/2').
-spec is_unanswered(counters:counters_ref()) -> boolean().
is_unanswered(Ref) ->
    counters:get(Ref, ?UNANSWERED_IX) =/= 0.

%% @doc Whether a sender over the node's bound may wait for room: not once a
%% wait for room ran out and the node did not answer a probe within `T' ms
%% (`barrier_timeout') since. The lane escalates when its probe goes unanswered
%% (`escalate/1'); a lane waiting on the node's busy connection cannot probe, so
%% a sender that looks `T' ms after the mark escalates too.
-spec may_wait_for_room(counters:counters_ref(), non_neg_integer()) -> boolean().
may_wait_for_room(Ref, T) ->
    case counters:get(Ref, ?UNANSWERED_IX) of
        2 ->
            case erlang:monotonic_time(millisecond) - counters:get(Ref, ?MARKED_AT_IX) < T of
                true -> true;
                false -> ok = escalate(Ref), false
            end;
        Level ->
            Level < 3
    end.

%% @doc The node answered: clear its mark (`unanswered/2').
-spec answered(counters:counters_ref()) -> ok.
answered(Ref) ->
    counters:put(Ref, ?UNANSWERED_IX, 0).

%% @doc Count one direct send with a sender's cached counters, unless their row
%% was forgotten (`closed': fetch the node's again). The mark is read in the
%% counters themselves, not in the node's held array (convoy_held's closed bit):
%% a direct send of a node idle between messages then touches one array
%% fewer (doc/decisions.md, "A direct send counts with one array").
-spec add_direct(counters:counters_ref()) -> ok | closed.
add_direct(Ref) ->
    case counters:get(Ref, ?CLOSED_IX) of
        0 -> counters:add(Ref, ?DIRECT_IX, 1);
        _ -> closed
    end.

%% @doc Messages and bytes held for a node now.
-spec held(convoy_held:held()) -> {integer(), integer()}.
held(H) ->
    convoy_held:read(H).

-spec add(counters:counters_ref(), counter(), integer()) -> ok.
add(_Ref, _Counter, 0) -> ok;
add(Ref, Counter, N) -> counters:add(Ref, index(Counter), N).

%% @doc Counter values of `Node' as a map.
-spec node_info(counters:counters_ref()) -> #{counter() => non_neg_integer()}.
node_info(Ref) ->
    maps:from_list([{C, counters:get(Ref, index(C))} || C <- ?COUNTERS]).

%% @doc Counter values of `Node' as `convoy:info/0' shows them: messages senders
%% sent themselves (`direct') count as accepted and sent too.
-spec node_counts(counters:counters_ref()) -> #{counter() => non_neg_integer()}.
node_counts(Ref) ->
    Counts = #{accepted := A, messages := M, direct := D} = node_info(Ref),
    Counts#{accepted := A + D, messages := M + D}.

%% @doc A node's figures as `convoy:info/0' shows them, from its row.
-spec node_report(plain | {convoy, pos_integer(), tuple()}, counters:counters_ref(),
                  convoy_held:held()) -> map().
node_report(Route, C, H) ->
    Counts = #{accepted := A, messages := M, dropped := D} = node_counts(C),
    {Queued, QueuedBytes} = held(H),
    Counts#{queued => max(0, Queued),
            queued_bytes => max(0, QueuedBytes),
            unanswered => is_unanswered(C),
            route => case Route of
                         plain -> plain;
                         {convoy, _, _} -> convoy
                     end,
            buffered => max(0, A - M - D)}.

index(accepted) -> 1;
index(messages) -> 2;
index(batches) -> 3;
index(dropped) -> 4;
index(received) -> 5;
index(direct) -> ?DIRECT_IX;
index(refused) -> 7;
index(blocked_us) -> 8;
index(chunked) -> 9;
index(stalled) -> 10;
index(waited_us) -> 11;
index(compressed_batches) -> 12;
index(compressed_bytes_in) -> 13;
index(compressed_bytes_out) -> 14.

%% @doc Count one rejected input; the first of each kind is logged.
-spec rejected(rejection()) -> ok.
rejected(Kind) ->
    rejected(Kind, #{}).

%% @doc `rejected/1' with what is known of the input (`from': the node that sent
%% it), for the log. The log names this node as it is named now, and the cause.
-spec rejected(rejection(), #{from => node()}) -> ok.
rejected(Kind, Context) ->
    Ix = rejection_index(Kind, ?REJECTIONS, 1),
    case atomics:add_get(persistent_term:get(?REJECTED), Ix, 1) of
        1 when Kind =/= undeliverable ->
            ?LOG_WARNING(Context#{what => convoy_rejected_input, kind => Kind, node => node(),
                                  cause => cause(Kind),
                                  note => "first of its kind; later ones are only counted"});
        _ ->
            ok
    end.

cause(bad_version) -> "a batch of a protocol version this node does not speak";
cause(malformed_batch) -> "a batch that is not a list of entries";
cause(bad_entry) -> "a malformed entry, a destination of another node than this one "
                        "(by name: see node), a barrier or piece for a third node, "
                        "or a multicast or publish of a message that is itself a batch";
cause(bad_hello) -> "a malformed hello or welcome";
cause(unknown_message) -> "a message no convoy process expects";
cause(unknown_node) -> "a batch from a node that is not connected";
cause(undeliverable) -> "a destination of an earlier incarnation of this node";
cause(too_costly) -> "a multicast entry over the limits";
cause(unsolicited) -> "a welcome that answers no request of this node";
cause(bad_piece) -> "a piece of no message held, out of sequence or past its size";
cause(partial_discarded) -> "a partial message whose sender or node went";
cause(reassembly_full) -> "a message in pieces over max_reassembly_bytes";
cause(bad_compressed) -> "a compressed batch that does not decode to a list of entries".

rejection_index(K, [K | _], I) -> I;
rejection_index(K, [_ | T], I) -> rejection_index(K, T, I + 1).

%% @doc Every kind of rejected input, counted 0 (`convoy:info/0' while convoy does
%% not run).
-spec no_rejections() -> #{rejection() => 0}.
no_rejections() ->
    maps:from_keys(?REJECTIONS, 0).

%% @doc All rejection counters.
-spec rejected() -> #{rejection() => non_neg_integer()}.
rejected() ->
    Ref = persistent_term:get(?REJECTED),
    maps:from_list(lists:zip(?REJECTIONS,
                             [atomics:get(Ref, I) || I <- lists:seq(1, length(?REJECTIONS))])).

%% @doc Fresh node-wide counters of `convoy_channel''s waits for credit. Write
%% concurrency: producers on different schedulers do not contend.
-spec new_waits() -> counters:counters_ref().
new_waits() ->
    counters:new(2, [write_concurrency]).

%% @doc Count one wait for credit that took `Dur' (native time units).
-spec add_wait(counters:counters_ref(), integer()) -> ok.
add_wait(Ref, Dur) ->
    counters:add(Ref, 1, 1),
    counters:add(Ref, 2, Dur).

%% @doc Waits for credit counted and their total time (native time units).
-spec waits(counters:counters_ref()) -> {non_neg_integer(), integer()}.
waits(Ref) ->
    {counters:get(Ref, 1), counters:get(Ref, 2)}.

%% @doc Emit a telemetry event when the `telemetry' setting (`On', from a runtime
%% the caller holds) is true and the `telemetry' module is loaded.
-spec emit(boolean(), [atom()], map(), map()) -> ok.
emit(true, Event, Measurements, Meta) -> execute(Event, Measurements, Meta);
emit(false, _Event, _Measurements, _Meta) -> ok.

%% @doc `emit/4' with the `telemetry' setting in force, for a caller that holds
%% no runtime (`convoy_channel'). While convoy is not running no setting is in
%% force and the setting's default applies: a channel works without convoy, and
%% its events with it.
-spec event([atom()], map(), map()) -> ok.
event(Event, Measurements, Meta) ->
    On = case persistent_term:get(?RUNTIME_KEY, undefined) of
             #runtime{telemetry = T} -> T;
             undefined -> maps:get(telemetry, convoy_config:defaults())
         end,
    emit(On, Event, Measurements, Meta).

execute(Event, Measurements, Meta) ->
    Mod = telemetry,
    case erlang:function_exported(Mod, execute, 3) of
        true -> Mod:execute(Event, Measurements, Meta), ok;
        false -> ok
    end.
