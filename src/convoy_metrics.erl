%% @private
%% Always-on counters and optional telemetry events.
%%
%% Per remote node: a `counters' array in the `convoy_nodes' table (owned by
%% `convoy_peers'), created by whoever first needs it. Node-independent rejections
%% (bad input) live in one `atomics' array so the first of each kind can be logged.
%% Telemetry events are emitted per batch or per episode, never per message, and only
%% when the `telemetry' module is loaded: there is no build dependency on it.
-module(convoy_metrics).

-export([init/0, node_counters/1, add/3, node_info/1, rejected/1, rejected/0,
         emit/3]).

-export_type([counter/0, rejection/0]).

-include_lib("kernel/include/logger.hrl").

-define(TABLE, convoy_nodes).
-define(REJECTED, {convoy, rejected}).

-type counter() :: accepted | messages | batches | dropped | received | direct.
-type rejection() :: bad_version | malformed_batch | bad_entry | bad_hello
                   | unknown_message | unknown_node | undeliverable.

-define(COUNTERS, [accepted, messages, batches, dropped, received, direct]).
-define(REJECTIONS, [bad_version, malformed_batch, bad_entry, bad_hello,
                     unknown_message, unknown_node, undeliverable]).

%% @doc Create the rejection counters (once per start of the application).
-spec init() -> ok.
init() ->
    persistent_term:put(?REJECTED, atomics:new(length(?REJECTIONS), [{signed, false}])).

%% @doc The counters of `Node', created on first use.
-spec node_counters(node()) -> counters:counters_ref().
node_counters(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, _Route, Ref}] ->
            Ref;
        [] ->
            Ref = counters:new(length(?COUNTERS), [write_concurrency]),
            ets:insert_new(?TABLE, {Node, plain, Ref}),
            [{_, _, Winner}] = ets:lookup(?TABLE, Node),
            Winner
    end.

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
index(direct) -> 6.

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
