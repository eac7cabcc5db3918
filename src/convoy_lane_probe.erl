%% @private
%% A lane's probes of nodes marked unanswered (`convoy_metrics:unanswered/2': a
%% sender's wait for the node ran out). A probe is a barrier to the lane, tagged
%% with the lane's secret: it rides behind the next batch to the node
%% (`behind/5'), or goes alone when the marking sender asks (`'$convoy_probe'',
%% `first/5'), and again each `barrier_timeout' until the node answers
%% (`answered/2'), which it does only once it took everything before the barrier.
%% A probe alone never waits for a busy connection (the next one is due soon), and
%% what it says is only that the node answers: it orders nothing.
%%
%% Runs in the lane: the barriers it makes answer `self()'. Its state is a map of
%% the probed nodes to when (ms) a probe was last sent to each.
-module(convoy_lane_probe).

-export([behind/5, first/4, due/4, timeout/3, answered/2]).

-export_type([probes/0]).

-type probes() :: #{node() => integer()}.

%% @doc The probe to put behind a batch to `Node' (whose counters are `C'), if the
%% node is marked and none went to it within `T' ms.
-spec behind(node(), counters:counters_ref(), reference(), non_neg_integer(), probes()) ->
          {[convoy_wire:entry()], probes()}.
behind(Node, C, Secret, T, Probes) ->
    case convoy_metrics:is_unanswered(C) of
        false ->
            {[], Probes};
        true ->
            Now = now_ms(),
            case Probes of
                #{Node := Sent} when Now - Sent < T -> {[], Probes};
                _ -> {[convoy_wire:barrier(self(), {Secret, Node})], Probes#{Node => Now}}
            end
    end.

%% @doc A marking sender asks lane `I' to probe `Node': a probe alone, unless the
%% node is probed already (again when due, `due/4').
-spec first(node(), pos_integer(), reference(), probes()) -> probes().
first(Node, _I, _Secret, Probes) when is_map_key(Node, Probes) ->
    Probes;
first(Node, I, Secret, Probes) ->
    alone(Node, now_ms(), first, I, Secret, Probes).

%% @doc Probes due again after `T' ms (end of each drain, and when the lane wakes
%% for them).
-spec due(pos_integer(), reference(), non_neg_integer(), probes()) -> probes().
due(_I, _Secret, _T, Probes) when map_size(Probes) =:= 0 ->
    Probes;
due(I, Secret, T, Probes) ->
    Now = now_ms(),
    maps:fold(fun(Node, Sent, Acc) when Now - Sent >= T -> alone(Node, Now, again, I, Secret, Acc);
                 (_Node, _Sent, Acc) -> Acc
              end, Probes, Probes).

%% @doc How long (ms) the lane may wait for its next message: its core's timeout,
%% or sooner for the next probe due.
-spec timeout(timeout(), non_neg_integer(), probes()) -> timeout().
timeout(CoreTimeout, _T, Probes) when map_size(Probes) =:= 0 ->
    CoreTimeout;
timeout(CoreTimeout, T, Probes) ->
    Due = lists:min(maps:values(Probes)) + T - now_ms(),
    min(CoreTimeout, max(0, Due)).

%% @doc `Node' answered a probe (any of them: each comes only once the node
%% answers): its mark is cleared.
-spec answered(node(), probes()) -> probes().
answered(Node, Probes) ->
    case convoy_peers:lookup(Node) of
        {_Route, C, _H} -> ok = convoy_metrics:answered(C);
        none -> ok
    end,
    maps:remove(Node, Probes).

%% The node's row is looked up, never created: probes outlive the lane's queue
%% for the node, and end with the mark or the row. A probe sent `again' means the
%% last one went unanswered for barrier_timeout (`convoy_metrics:escalate/1').
alone(Node, Now, Which, I, Secret, Probes) ->
    case convoy_peers:lookup(Node) of
        {{convoy, _Vsn, Inboxes}, C, _H} ->
            case convoy_metrics:is_unanswered(C) of
                true ->
                    _ = Which =:= first orelse convoy_metrics:escalate(C),
                    Batch = convoy_wire:batch(node(),
                                              [convoy_wire:barrier(self(), {Secret, Node})]),
                    _ = erlang:send({convoy_wire:lane_inbox(I, Inboxes), Node}, Batch,
                                    [nosuspend, noconnect]),
                    Probes#{Node => Now};
                false ->
                    maps:remove(Node, Probes)
            end;
        _PlainOrNone ->
            maps:remove(Node, Probes)
    end.

now_ms() -> erlang:monotonic_time(millisecond).
