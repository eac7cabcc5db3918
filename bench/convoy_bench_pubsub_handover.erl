%% The `handover' variant of the `pubsub' scenario: a Phoenix.PubSub adapter
%% that is `Phoenix.PubSub.Convoy' (its workers, groups and message) with each
%% remote part of a broadcast handed to `convoy_bench_handover''s batcher instead
%% of `convoy:send/3': no counters, no bounds, no order rules beyond one
%% mailbox's. It is the limit of any adapter that batches by handing each message
%% to a process, measured beside convoy's and PG2's. A measurement, not an
%% adapter to use.
-module(convoy_bench_pubsub_handover).

%% The Phoenix.PubSub.Adapter callbacks.
-export([node_name/1, broadcast/4, direct_broadcast/5, child_spec/1]).

-define(CONVOY_ADAPTER, 'Elixir.Phoenix.PubSub.Convoy').
%% The :pg scope of Phoenix.PubSub's adapters.
-define(SCOPE, 'Elixir.Phoenix.PubSub').

-spec node_name(atom()) -> node().
node_name(_AdapterName) ->
    node().

%% @doc As `Phoenix.PubSub.Convoy.broadcast/4': the caller's group's worker on
%% each other node gets one message, handed to this node's batcher.
-spec broadcast(atom(), binary(), term(), module()) -> ok.
broadcast(AdapterName, Topic, Message, Dispatcher) ->
    Here = node(),
    Forward = {forward_to_local, Topic, Message, Dispatcher},
    lists:foreach(fun(Pid) when node(Pid) =:= Here -> ok;
                     (Pid) -> convoy_bench_handover:send(Pid, Forward)
                  end, pg:get_members(?SCOPE, group(AdapterName))),
    ok.

-spec direct_broadcast(atom(), node(), binary(), term(), module()) -> ok.
direct_broadcast(AdapterName, Node, Topic, Message, Dispatcher) ->
    {Groups, PubSub, _Policy} = persistent_term:get({?CONVOY_ADAPTER, AdapterName}),
    case Node =:= node() of
        true ->
            'Elixir.Phoenix.PubSub':local_broadcast(PubSub, Topic, Message, Dispatcher);
        false ->
            convoy_bench_handover:send({pick(Groups), Node},
                                       {forward_to_local, Topic, Message, Dispatcher})
    end.

%% @doc Phoenix.PubSub.Convoy's workers (they dispatch what reaches them).
-spec child_spec(list()) -> map().
child_spec(Opts) ->
    ?CONVOY_ADAPTER:child_spec(Opts).

%% The caller's group, as Phoenix.PubSub.Convoy (and PG2) pick it.
group(AdapterName) ->
    {Groups, _PubSub, _Policy} = persistent_term:get({?CONVOY_ADAPTER, AdapterName}),
    pick(Groups).

pick(Groups) -> element(erlang:phash2(self(), tuple_size(Groups)) + 1, Groups).
