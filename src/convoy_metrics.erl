%% @private
%% Always-on counters and optional telemetry events.
%%
%% Per remote node: a `counters' array in the `convoy_nodes' table (owned by
%% `convoy_peers'), created by whoever first needs it. Node-independent rejections
%% (bad input) live in one `atomics' array so the first of each kind can be logged.
%% Telemetry events are emitted per batch or per episode, never per message, and only
%% when the `telemetry' module is loaded: there is no build dependency on it.
-module(convoy_metrics).

-export([init/0, lost/1, lost/0, node_counters/1, node_refs/1, detached_refs/0, add/3, node_info/1, held/1, rejected/1,
         rejected/0, emit/3]).

-export_type([counter/0, rejection/0]).

-include_lib("kernel/include/logger.hrl").

-define(TABLE, convoy_nodes).
-define(REJECTED, {convoy, rejected}).
-define(LOST, {convoy, lost}).

-type counter() :: accepted | messages | batches | dropped | received | direct
                 | refused | blocked_us.
-type rejection() :: bad_version | malformed_batch | bad_entry | bad_hello
                   | unknown_message | unknown_node | undeliverable | too_costly.

-define(COUNTERS, [accepted, messages, batches, dropped, received, direct, refused,
                   blocked_us]).
-define(REJECTIONS, [bad_version, malformed_batch, bad_entry, bad_hello,
                     unknown_message, unknown_node, undeliverable, too_costly]).

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

%% @doc The counters of `Node', created on first use.
-spec node_counters(node()) -> counters:counters_ref().
node_counters(Node) ->
    element(1, node_refs(Node)).

%% @doc The counters of `Node' and its held-message atomics (1: messages handed to a
%% lane and not yet sent or dropped, 2: their estimated bytes), created on first use.
-spec node_refs(node()) -> {counters:counters_ref(), atomics:atomics_ref()}.
node_refs(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, _Route, C, H}] ->
            {C, H};
        [] ->
            C = counters:new(length(?COUNTERS), [write_concurrency]),
            H = atomics:new(2, [{signed, true}]),
            ets:insert_new(?TABLE, {Node, plain, C, H}),
            [{_, _, C1, H1}] = ets:lookup(?TABLE, Node),
            {C1, H1}
    end.

%% @doc Counters and held-message atomics that belong to no node row, for a process
%% that must keep counting while convoy's node table is gone.
-spec detached_refs() -> {counters:counters_ref(), atomics:atomics_ref()}.
detached_refs() ->
    {counters:new(length(?COUNTERS), []), atomics:new(2, [{signed, true}])}.

%% @doc Messages and bytes held for a node now.
-spec held(atomics:atomics_ref()) -> {integer(), integer()}.
held(H) ->
    {atomics:get(H, 1), atomics:get(H, 2)}.

-spec add(counters:counters_ref(), counter(), integer()) -> ok.
add(_Ref, _Counter, 0) -> ok;
add(Ref, Counter, N) -> counters:add(Ref, index(Counter), N).

%% @doc Counter values of `Node' as a map.
-spec node_info(counters:counters_ref()) -> #{counter() => non_neg_integer()}.
node_info(Ref) ->
    maps:from_list([{C, counters:get(Ref, index(C))} || C <- ?COUNTERS]).

index(accepted) -> 1;
index(messages) -> 2;
index(batches) -> 3;
index(dropped) -> 4;
index(received) -> 5;
index(direct) -> 6;
index(refused) -> 7;
index(blocked_us) -> 8.

%% @doc Count one rejected input; the first of each kind is logged.
-spec rejected(rejection()) -> ok.
rejected(Kind) ->
    Ix = rejection_index(Kind, ?REJECTIONS, 1),
    case atomics:add_get(persistent_term:get(?REJECTED), Ix, 1) of
        1 when Kind =/= undeliverable ->
            ?LOG_WARNING(#{what => convoy_rejected_input, kind => Kind,
                           note => "first of its kind; later ones are only counted"});
        _ ->
            ok
    end.

rejection_index(K, [K | _], I) -> I;
rejection_index(K, [_ | T], I) -> rejection_index(K, T, I + 1).

%% @doc All rejection counters.
-spec rejected() -> #{rejection() => non_neg_integer()}.
rejected() ->
    Ref = persistent_term:get(?REJECTED),
    maps:from_list(lists:zip(?REJECTIONS,
                             [atomics:get(Ref, I) || I <- lists:seq(1, length(?REJECTIONS))])).

%% @doc Emit a telemetry event if `telemetry' is loaded.
-spec emit([atom()], map(), map()) -> ok.
emit(Event, Measurements, Meta) ->
    Mod = telemetry,
    case erlang:function_exported(Mod, execute, 3) of
        true -> Mod:execute(Event, Measurements, Meta), ok;
        false -> ok
    end.
