%% @private
%% The sender's side of `convoy:send/2' and `convoy:multicast/2': runs in the
%% caller's process and decides the path of each message.
%%
%% Ordering rests on three rules.
%% <ol>
%% <li>A sender always uses the same lane: `phash2(self(), Lanes)'. A lane ships each
%%   node's queue in order, always to the same inbox of that node, and the inbox
%%   delivers batches in arrival order.</li>
%% <li>A sender may bypass its lane only when the lane is idle: every admission to the
%%   lane (`atomics:add_get' on its slot) has been disposed of. Then everything the
%%   sender handed over before is already in the distribution connection, which
%%   delivers in order what it was given in order; the sender's own message goes in
%%   behind it. The idle test and the admission are one `add_get' plus one read.
%%   For a small message the lane must also have been quiet: no small message took
%%   it in the last `bypass_after' microseconds. An idle lane under a steady flood
%%   is not quiet, so a flood is batched instead of leaking out one message at a
%%   time, while a lone request/response pays no extra hop. A busy lane counts as
%%   quiet when batching does not pay there (`convoy_path:streams/2' and
%%   `pays/3'), and a quiet one as busy while it pays (`quiet/2'): that changes
%%   which of these safe paths is taken, never the rules.</li>
%% <li>Bypassing the inbox too (sending straight to the destination process) is
%%   allowed only when none of the sender's earlier messages to that node can still
%%   be waiting in an inbox: the sender's marker for `Node' (in its process
%%   dictionary) says its traffic to `Node' went through a lane or an inbox since
%%   its last barrier. A barrier (an entry the inbox answers once everything before
%%   it is delivered) clears it: a marked sender waits for one before it sends a
%%   large message, and sends one behind a small message after its lane has been
%%   calm for a while (see `convoy_path'). Idle round trips thus cost what plain
%%   `!' costs, after a burst as before it.</li>
%% </ol>
%% The decision of each message's path is `convoy_path''s (pure); this module
%% gathers the facts and carries it out.
%% When convoy stops, the runtime is published marked `stopping' and every lane is
%% closed: a sender with messages in its lane or an inbox (the marker above) waits
%% until its lane is gone, which it is only once everything it held has shipped and
%% each peer's inbox has confirmed delivery; then the sender sends plainly. So
%% plain sends never overtake convoy's, and convoy's after a restart follow plain
%% ones in the same connection.
%%
%% Large messages (`large_threshold') skip the lane so they are copied no more than
%% a plain send copies them: the sender waits for a barrier (at most
%% `barrier_timeout' ms) if it has inbox traffic outstanding, then sends directly.
%% If the barrier does not come back in time the message goes through the lane.
%% From `chunk_threshold' on, to a peer at protocol version 2, a large message
%% that may go directly (unmarked sender) or bypass its idle lane (marked sender)
%% goes in pieces through the lane's inbox instead (`convoy_chunk_send'): the
%% inbox is where rule 1 puts the sender's earlier traffic, and the sender returns
%% only once the inbox delivered it, so rule 3's marker is cleared as by a
%% barrier. A marked sender whose lane is busy first waits (at most
%% `barrier_timeout' ms) for the lane to ship what it holds for the node, as
%% `convoy:flush/1' does, then sends the pieces behind it; if the lane takes
%% longer, the lane gets the message whole, as before.
-module(convoy_route).

-export([send/2, send/3, send_remote/3, send_many/1, multicast/2, multicast_entry/3, lane_of/1,
         is_marked/1]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").
-include("convoy_policy.hrl").

-define(DIRECT_OPTS, [nosuspend, noconnect]).

%% One remote message on its way (a single send's, or a multicast entry's): the
%% runtime with the call's options, the sender's lane, the node, the destination
%% there (a multicast entry's list of them, or a `pg' group), the message, its
%% encoded size once measured (`{small | multicast | large, Bytes}'), and whether
%% it is a multicast entry.
-record(send, {rt :: #runtime{},
               lane :: pos_integer(),
               node :: node(),
               to :: term(),
               msg :: term(),
               size :: undefined | {small | multicast | large, non_neg_integer()},
               entry = false :: boolean()}).

%% The small steps of every remote send (measured: `bin/convoy-bench cost').
-compile({inline, [resolve/1, local_or_remote/2, with_opts/2, slots/2, is_marked/1,
                   size_kind/1, idle/3, hold/3, mark/1, mark_lane/1, own/0, skipped/0, now_us/1,
                   gaps/2, kind/1, hand_over/1, dispose/1, admission/2, context/6]}).

%% @doc See `convoy:send/2'.
-spec send(convoy:dest(), term()) -> ok.
send(Pid, Msg) when is_pid(Pid), node(Pid) =:= node() ->
    Pid ! Msg, % local: exactly `!', nothing else to decide
    ok;
send(Name, Msg) when is_atom(Name) ->
    Name ! Msg,
    ok;
send(Pid, Msg) when is_pid(Pid) ->
    send_remote(node(Pid), Pid, Msg);
send(Dest, Msg) ->
    ok = send(Dest, Msg, #{}).

%% @doc `send/2' to a pid of another node, `Node' (`convoy:send/2' read it).
-spec send_remote(node(), pid(), term()) -> ok.
send_remote(Node, Pid, Msg) ->
    remote(persistent_term:get(?RUNTIME_KEY, undefined), Node, Pid, Msg).

%% @doc See `convoy:send/3' (options already checked there).
-spec send(convoy:dest(), term(), convoy:send_options()) -> ok | {error, overload}.
send(Dest, Msg, Opts) ->
    case resolve(Dest) of
        local ->
            erlang:send(Dest, Msg),
            ok;
        {local, _Name} ->
            %% as `!': badarg for an unregistered Name, nothing for {Name, node()}
            erlang:send(Dest, Msg),
            ok;
        {remote, Node, To} ->
            remote(with_opts(persistent_term:get(?RUNTIME_KEY, undefined), Opts), Node, To,
                   Msg);
        error ->
            erlang:error(badarg, [Dest, Msg])
    end.

%% @doc See `convoy:send_many/1'.
-spec send_many([{convoy:dest(), term()}]) -> ok.
send_many(Sends) ->
    {Local, Remote} = resolve_many(Sends, Sends, [], #{}, []),
    lists:foreach(fun({Pid, Msg}) -> erlang:send(Pid, Msg) end, Local),
    many(persistent_term:get(?RUNTIME_KEY, undefined), Remote).

%% Everything is checked before anything is sent (as `multicast/2'): local
%% names are looked up once, remote messages are grouped by node in list order
%% (`Nodes' the nodes in the order first met).
resolve_many([], _All, Local, Remote, Nodes) ->
    {lists:reverse(Local),
     [{Node, lists:reverse(maps:get(Node, Remote))} || Node <- lists:reverse(Nodes)]};
resolve_many([{Dest, Msg} | Rest], All, Local, Remote, Nodes) ->
    case resolve(Dest) of
        local ->
            resolve_many(Rest, All, [{Dest, Msg} | Local], Remote, Nodes);
        {local, Name} ->
            case whereis(Name) of
                undefined when is_atom(Dest) -> erlang:error(badarg, [All]);
                undefined -> resolve_many(Rest, All, Local, Remote, Nodes);
                Pid -> resolve_many(Rest, All, [{Pid, Msg} | Local], Remote, Nodes)
            end;
        {remote, Node, To} ->
            case Remote of
                #{Node := Tos} ->
                    resolve_many(Rest, All, Local, Remote#{Node := [{To, Msg} | Tos]}, Nodes);
                _ ->
                    resolve_many(Rest, All, Local, Remote#{Node => [{To, Msg}]}, [Node | Nodes])
            end;
        error ->
            erlang:error(badarg, [All])
    end;
resolve_many(_Improper, All, _Local, _Remote, _Nodes) ->
    erlang:error(badarg, [All]).

%% Remote messages of `send_many/1', by node. While convoy runs, a node's small
%% messages go to the sender's lane together: one admission, room taken for all
%% of them at once, and one hand-over for every such node. A node for which that
%% is not the plain case (a large message among them, no room for all of them
%% at once, a message in pieces not yet confirmed) gets its messages one by one,
%% as `send/2' sends them, after the hand-over: messages to one node keep their
%% order, and nothing orders messages to different nodes.
many(RT = #runtime{stopping = false, large_threshold = T}, Remote) ->
    {Together, OneByOne} = lists:foldr(
                             fun({Node, Tos} = Group, {Tg, One}) ->
                                     case is_pieces(marker(Node)) of
                                         false ->
                                             case entries(Node, Tos, T, [], 0) of
                                                 {Entries, Bytes} ->
                                                     {[{Node, Entries, Bytes, Group} | Tg], One};
                                                 large ->
                                                     {Tg, [Group | One]}
                                             end;
                                         true ->
                                             {Tg, [Group | One]}
                                     end
                             end, {[], []}, Remote),
    Left = together(RT, Together),
    one_by_one(RT, Left ++ OneByOne);
many(RT, Remote) ->
    one_by_one(RT, Remote).

is_pieces({pieces, _}) -> true;
is_pieces(_) -> false.

%% The lane's sends for Node's messages, newest first, with their bytes; `large'
%% if one of them is.
entries(_Node, [], _T, Entries, Bytes) ->
    {Entries, Bytes};
entries(Node, [{To, Msg} | Rest], T, Entries, Bytes) ->
    case convoy_size:measure(Msg, T) of
        {small, B} -> entries(Node, Rest, T, [{?TAG_SEND, Node, To, Msg, B} | Entries],
                              Bytes + B);
        {large, _} -> large
    end.

one_by_one(RT, Remote) ->
    lists:foreach(fun({Node, Tos}) ->
                          lists:foreach(fun({To, Msg}) -> _ = remote(RT, Node, To, Msg) end, Tos)
                  end, Remote).

%% One admission for every message; on an idle lane, each node's messages (at
%% most max_batch) straight to the inbox the lane ships to, as one batch (rule
%% 2: what the sender handed over before is in the connection); else, or if the
%% connection is busy, room per node for all its messages and one hand-over to
%% the lane, the admissions of the messages it does not take disposed of at
%% once. Returns the nodes left to send one by one.
together(RT, Nodes) ->
    admit_many(RT, Nodes, fun(L, Slots, V, K) ->
        case may_bypass_many(RT) andalso idle(RT, L, V - K + 1) of
            true ->
                %% Idle: nothing of this sender's is left in the lane, and the
                %% batches to the inbox need no admission. It is disposed of
                %% before they are encoded (which takes long for large ones), so
                %% a sender killed meanwhile holds none; the nodes the inbox did
                %% not take are admitted again for the hand-over.
                ok = convoy_slots:dispose(Slots, K),
                ToLane = [G || G <- Nodes, not via_inbox_many(RT, L, G)],
                admit_many(RT, ToLane, fun(L1, Slots1, _V, K1) ->
                                               hand_over_many(RT, L1, Slots1, ToLane, K1)
                                       end);
            false ->
                hand_over_many(RT, L, Slots, Nodes, K)
        end
    end).

%% One admission for the messages of Nodes, then Admitted(L, Slots, V, K); on a
%% closed lane (retired or stopping, its successor published) they start again.
admit_many(_RT, [], _Admitted) ->
    [];
admit_many(RT, Nodes, Admitted) ->
    L = lane_of(RT),
    Slots = slots(RT, L),
    K = lists:foldl(fun({_Node, _Entries, _Bytes, {_, Tos}}, Acc) -> Acc + length(Tos) end, 0,
                    Nodes),
    V = convoy_slots:admit_many(Slots, K),
    case convoy_slots:is_closed(V) of
        true ->
            many(refreshed(RT), [Group || {_Node, _Entries, _Bytes, Group} <- Nodes]),
            [];
        false ->
            Admitted(L, Slots, V, K)
    end.

%% Admitted K: the nodes with room for all their messages go to the lane in one
%% hand-over, the rest of the admissions are disposed of at once (no wait between
%% the admission and either). Returns the nodes left to send one by one.
hand_over_many(#runtime{lanes = Lanes} = RT, L, Slots, Nodes, K) ->
    {Sends, N, Left} = held_sends(RT, Nodes, [], 0, []),
    ok = convoy_slots:dispose(Slots, K - N),
    _ = N =:= 0 orelse erlang:send(element(L, Lanes), {?TAG_SENDS, Sends, N}),
    Left.

%% A send_many's batch may bypass an idle lane unless batching is forced: it is a
%% batch already, so the lane's calm does not matter.
may_bypass_many(#runtime{bypass_after = never}) -> false;
may_bypass_many(_RT) -> true.

%% A node's messages (`{To, Msg}', the wire's entries already) to the inbox this
%% sender's lane ships to (`to_inbox/4'): sent (counted direct), or not (too
%% many for one batch, a peer that is not an answering convoy node, a busy
%% connection).
via_inbox_many(#runtime{max_batch = MaxBatch}, L, {Node, _Entries, _Bytes, {Node, Tos}}) ->
    K = length(Tos),
    case K =< MaxBatch andalso node_row(Node) of
        {convoy, C, Inboxes} ->
            case to_inbox(L, Node, Inboxes, Tos) of
                ok ->
                    convoy_metrics:add(C, direct, K),
                    true;
                _NoSuspendOrNoConnect ->
                    false
            end;
        _ ->
            false
    end.

%% The lane's sends, newest first, for every node that had room for all its
%% messages (each such node marked: its messages go through the lane).
held_sends(_RT, [], Sends, N, Left) ->
    {Sends, N, lists:reverse(Left)};
held_sends(RT, [{Node, Entries, Bytes, {_, Tos} = Group} | Rest], Sends, N, Left) ->
    K = length(Tos),
    case hold_many(RT, Node, K, Bytes) of
        ok ->
            mark_lane(Node),
            held_sends(RT, Rest, Entries ++ Sends, N + K, Left);
        _FullOrClosed ->
            held_sends(RT, Rest, Sends, N, [Group | Left])
    end.

hold_many(#runtime{max_buffered = MaxN, max_buffered_bytes = MaxB}, Node, K, Bytes) ->
    {_C, H} = refs(Node),
    convoy_held:hold_many(H, K, Bytes, MaxN, MaxB).

%% @doc See `convoy:multicast/2'.
-spec multicast([convoy:dest()], term()) -> ok.
multicast(Dests, Msg) when is_list(Dests) ->
    {Local, Remote} = group(Dests, Msg, [], #{}),
    lists:foreach(fun(D) -> erlang:send(D, Msg) end, Local),
    RT = persistent_term:get(?RUNTIME_KEY, undefined),
    %% Split into entries a peer's inbox accepts (convoy_wire's cost limit).
    maps:foreach(fun(Node, Tos) ->
                         lists:foreach(fun({Ts, _}) -> remote_multi(RT, Node, Ts, Msg) end,
                                       convoy_wire:multicast_entries(Tos, Msg))
                 end, Remote);
multicast(Dests, Msg) ->
    erlang:error(badarg, [Dests, Msg]).

%% @doc One multicast entry to `Node': `Tos' (destinations on `Node', within the
%% inbox's cost limit, see `convoy_wire:multicast_entries/2') or a `pg' group
%% (`{'$convoy_publish', Scope, Group}', for a peer that reads publish entries).
%% It takes the path of `multicast/2''s entries, so it keeps its place among the
%% caller's other messages to `Node'.
-spec multicast_entry(node(), [convoy:dest()] | {?TAG_PUBLISH, atom(), term()}, term()) ->
          ok.
multicast_entry(Node, Tos, Msg) ->
    remote_multi(persistent_term:get(?RUNTIME_KEY, undefined), Node, Tos, Msg).

%% Everything is checked before anything is sent, so a bad destination raises
%% badarg with nothing sent. Remote pids of one node in a row (as a list of a
%% group's members usually comes) are gathered before the map is touched: a map
%% update per pid cost about four times the whole walk.
group([], _Msg, Local, Remote) ->
    {lists:reverse(Local), maps:map(fun(_, Tos) -> lists:reverse(Tos) end, Remote)};
group([D | Rest], Msg, Local, Remote) when is_pid(D), node(D) =/= node() ->
    remote_run(node(D), D, Rest, Msg, Local, Remote);
group([D | Rest], Msg, Local, Remote) ->
    case resolve(D) of
        local ->
            group(Rest, Msg, [D | Local], Remote);
        {local, Name} ->
            %% as `!' would do: badarg for an unregistered Name, while a message
            %% to an unregistered {Name, node()} is dropped
            case whereis(Name) of
                undefined when is_atom(D) -> erlang:error(badarg, [[D | Rest], Msg]);
                undefined -> group(Rest, Msg, Local, Remote);
                Pid -> group(Rest, Msg, [Pid | Local], Remote)
            end;
        {remote, Node, To} ->
            remote_run(Node, To, Rest, Msg, Local, Remote);
        error ->
            erlang:error(badarg, [[D | Rest], Msg])
    end.

%% To on Node, and the pids of Node right after it, added to Node's list at once.
remote_run(Node, To, Rest, Msg, Local, Remote) ->
    {Rest1, Tos} = same_node(Node, Rest, [To | maps:get(Node, Remote, [])]),
    group(Rest1, Msg, Local, Remote#{Node => Tos}).

%% The pids of Node that follow, newest first on Tos.
same_node(Node, [D | Rest], Tos) when is_pid(D), node(D) =:= Node ->
    same_node(Node, Rest, [D | Tos]);
same_node(_Node, Rest, Tos) ->
    {Rest, Tos}.

%% send/3 options apply to this call: a refused message is reported, not dropped.
with_opts(RT, Opts) when map_size(Opts) =:= 0; RT =:= undefined ->
    RT;
with_opts(RT = #runtime{overload = O, block_timeout = T}, Opts) ->
    RT#runtime{overload = maps:get(overload, Opts, O),
               block_timeout = maps:get(block_timeout, Opts, T),
               refuse = error}.

%% The runtime republished by a lane change or a stop, with this call's options
%% kept; undefined once convoy has stopped.
refreshed(#runtime{overload = O, block_timeout = T, refuse = R}) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined -> undefined;
        RT -> RT#runtime{overload = O, block_timeout = T, refuse = R}
    end.

resolve(Pid) when is_pid(Pid) -> local_or_remote(node(Pid), Pid);
resolve(Ref) when is_reference(Ref) -> local_or_remote(node(Ref), Ref);
resolve(Name) when is_atom(Name) -> {local, Name};
resolve({Name, Node}) when is_atom(Name), is_atom(Node) ->
    case Node =:= node() of
        true -> {local, Name};
        false -> {remote, Node, Name}
    end;
resolve(_) -> error.

local_or_remote(Node, Dest) ->
    case Node =:= node() of
        true -> local;
        false -> {remote, Node, Dest}
    end.

%% @doc The lane index of the calling process.
-spec lane_of(#runtime{}) -> pos_integer().
lane_of(#runtime{n = 1}) -> 1;
lane_of(#runtime{n = N}) -> erlang:phash2(self(), N) + 1.

slots(#runtime{slots = Slots}, L) -> element(L, Slots).

%% The sender's own state is kept in its process dictionary under atom keys (an
%% atom key hashes and compares at once, where a tuple key per node is walked on
%% every lookup). MARKED_KEY is a map by node: the nodes this sender's traffic
%% went to through a lane or an inbox since its last barrier (each `true', or
%% `{pieces, Inbox}', see `settle/5'). OWN_KEY holds its own part of the
%% adaptive policy (`convoy_path:own()', see `unmarked_calm/3').
-define(MARKED_KEY, '$convoy_marked').
%% The sender's own part of the policy (`convoy_path:own()'): its reused calm and
%% its last recorded send to each node; and beside it, the records a marked
%% sender skipped in a row (an integer: no allocation on a flood's sends).
-define(OWN_KEY, '$convoy_own').
-define(SKIPPED_KEY, '$convoy_skipped').

%% A marker is `true', or `{pieces, Inbox}' when the sender's last message in
%% pieces went through the peer's `Inbox', its delivery was not confirmed, and
%% everything the sender sent to the node since went straight to that inbox (see
%% `settle/5'). A message handed to the lane turns it into `true'
%% (`mark_lane/1').

%% @doc Whether the calling process's traffic to `Node' went through a lane or an
%% inbox since its last barrier (for tests).
-spec is_marked(node()) -> boolean().
is_marked(Node) ->
    marker(Node) =/= false.

marker(Node) ->
    case get(?MARKED_KEY) of
        #{Node := Marker} -> Marker;
        _ -> false
    end.

%% Marks Node for a message sent straight to an inbox, keeping a
%% `{pieces, Inbox}' marker as it is: the message is in the connection behind
%% the pieces.
mark(Node) ->
    case get(?MARKED_KEY) of
        undefined -> put(?MARKED_KEY, #{Node => true});
        #{Node := _} -> ok;
        Marked -> put(?MARKED_KEY, Marked#{Node => true})
    end,
    ok.

%% Marks Node for a message handed to the lane: the marker is `true', whatever
%% it was. The lane may still hold the message, so nothing may go straight to
%% the inbox of a `{pieces, Inbox}' marker any more (`behind_pieces/5' would
%% overtake it). Nor need it: the lane ships to that inbox, behind the pieces,
%% and whatever confirms the lane's traffic confirms them too (a lane change's
%% barriers before the node is released in the new lanes, a stop's before the
%% lane goes, a barrier through the lane's inbox).
mark_lane(Node) ->
    case get(?MARKED_KEY) of
        undefined -> put(?MARKED_KEY, #{Node => true});
        #{Node := true} -> ok;
        Marked -> put(?MARKED_KEY, Marked#{Node => true})
    end,
    ok.

set_marker(Node, Marker) ->
    case get(?MARKED_KEY) of
        undefined -> put(?MARKED_KEY, #{Node => Marker});
        Marked -> put(?MARKED_KEY, Marked#{Node => Marker})
    end,
    ok.

unmark(Node) ->
    case get(?MARKED_KEY) of
        #{Node := _} = Marked when map_size(Marked) =:= 1 -> erase(?MARKED_KEY);
        #{Node := _} = Marked -> put(?MARKED_KEY, maps:remove(Node, Marked));
        _ -> ok
    end,
    ok.

%% One message to a remote node; convoy_path decides the path from the facts.
remote(undefined, Node, To, Msg) ->
    after_pieces(undefined, Node, {To, Msg}, fun() -> plain_send(Node, [To], Msg) end);
remote(RT = #runtime{stopping = true}, Node, To, Msg) ->
    after_pieces(RT, Node, {To, Msg}, fun() -> stopping(RT, Node, [To], Msg) end);
remote(RT = #runtime{large_threshold = T}, Node, To, Msg) ->
    L = lane_of(RT),
    Size = convoy_size:measure(Msg, T), % measured once: {small | large, Bytes}
    case marker(Node) of
        {pieces, Inbox} ->
            S = context(RT, L, Node, To, Msg, Size),
            case lane_inbox(L, Node) of
                Inbox -> route_marked(S);
                _Other -> settle(RT, Node, Inbox, {To, Msg}, fun() -> route_marked(S) end)
            end;
        true ->
            marked(RT, L, Node, To, Msg, Size);
        false ->
            unmarked(RT, L, Node, To, Msg, Size)
    end.

%% An unmarked sender's message: one that goes directly (a small one on a calm
%% lane, a large one) has its context made only if it does not: the path of an
%% idle request/response makes none.
unmarked(RT, L, Node, To, Msg, Size) ->
    Calm = case Size of
               {large, _} -> busy; % not a small send: the lane's calm is not touched
               _ -> unmarked_calm(RT, L, Node)
           end,
    case convoy_path:unadmitted(size_kind(Size), Calm, false) of
        direct -> direct(RT, L, Node, To, Msg, Size);
        admit -> admit(context(RT, L, Node, To, Msg, Size), {calm, Calm})
    end.

%% A single message's context (a multicast entry's is made in `multi/5').
context(RT, L, Node, To, Msg, Size) ->
    #send{rt = RT, lane = L, node = Node, to = To, msg = Msg, size = Size}.

%% The message again, from the start, under the runtime republished by a lane
%% change or a stop (its lane was closed when it asked for admission).
restart(#send{rt = RT, node = Node, to = Tos, msg = Msg, entry = true}) ->
    remote_multi(refreshed(RT), Node, Tos, Msg);
restart(#send{rt = RT, node = Node, to = To, msg = Msg}) ->
    remote(refreshed(RT), Node, To, Msg).

%% A marked sender's message: it is admitted first, and while its lane holds
%% messages a small one goes to the lane with nothing else decided (rule 2: only
%% an idle lane may be bypassed, so the lane's calm cannot change the path).
%% While anything is held for the node the lane is taken as busy without
%% reading it (`convoy_held:hold_behind/4': the read that takes the message's
%% room answers it); only when nothing is held is the lane's idleness read.
%% This is the path of every message of a flood: its sender reads the clock
%% only for one send in SKIP_MAX + 1 (`skipped_record/3'), and its context
%% (`#send{}') is made only off that path.
marked(RT = #runtime{max_buffered = MaxN, max_buffered_bytes = MaxB}, L, Node, To, Msg,
       {small, Bytes} = Size) ->
    case admission(RT, L) of
        closed ->
            remote(refreshed(RT), Node, To, Msg);
        V ->
            {C, H} = refs(Node),
            case convoy_held:hold_behind(H, Bytes, MaxN, MaxB) of
                empty ->
                    Calm = unheld_calm(RT, L, Node, V),
                    case convoy_path:may_bypass(small, Calm) of
                        true ->
                            bypass(context(RT, L, Node, To, Msg, Size), Calm);
                        false ->
                            held_to_lane(hold(RT, H, Bytes), RT, L, Node, To, Msg, Bytes, C, H)
                    end;
                Held ->
                    skipped_record(RT, L, Node),
                    held_to_lane(Held, RT, L, Node, To, Msg, Bytes, C, H)
            end
    end;
marked(RT, L, Node, To, Msg, Size) ->
    route_marked(context(RT, L, Node, To, Msg, Size)).

%% With nothing held for the node, a marked sender's lane as its small send
%% finds it: busy while the lane still holds admitted messages (recorded as a
%% skip, `skipped_record/3'), else its calm (`marked_calm/3').
unheld_calm(RT, L, Node, V) ->
    case idle(RT, L, V) of
        false ->
            skipped_record(RT, L, Node),
            busy;
        true ->
            marked_calm(RT, L, Node)
    end.

%% A marked sender's message off a flood's path (a large one, or one after a
%% message in pieces): always admitted first (rule 3, `convoy_path:unadmitted/3'),
%% the lane's calm read for a small one.
route_marked(S = #send{rt = RT, lane = L, node = Node, size = Size}) ->
    Calm = case Size of
               {large, _} -> busy;
               _ -> marked_calm(RT, L, Node)
           end,
    admit(S, {calm, Calm}).

%% A message or multicast entry admitted to its lane (`admission/2', the one
%% admission of a single message or entry; `send_many/1' admits a node's
%% messages together and disposes of those without room, in `together/2'). On a
%% closed lane (retired or stopping; its successor is already published) the
%% message starts again. Once admitted, a message must be disposed of exactly
%% once: by the lane when it ships it (`to_lane/1' and the paths that end
%% there), or by the sender, through `dispose/1' (`together/2' for its own),
%% when it sent the message itself, in pieces, or not at all (refused or
%% dropped).
%% Nothing after the admission may fail. The accounting is checked by a PropEr
%% model on live nodes (test/convoy_accounting_SUITE.erl).
admit(S = #send{rt = RT, lane = L}, Then) ->
    case admission(RT, L) of
        closed -> restart(S);
        V -> admitted(S, Then, V)
    end.

%% The admission itself: the lane's admission count after it (see `idle/3'), or
%% `closed'. Every admission of a single message or entry is this call.
admission(RT, L) ->
    V = convoy_slots:admit(slots(RT, L)),
    case convoy_slots:is_closed(V) of
        true -> closed;
        false -> V
    end.

%% Admitted: whether the lane is idle is read only when the message may bypass
%% it.
admitted(S = #send{rt = RT, lane = L, size = Size}, {calm, Calm}, V) ->
    case convoy_path:may_bypass(size_kind(Size), Calm) andalso idle(RT, L, V) of
        true -> bypass(S, Calm);
        false -> busy_lane(S)
    end;
admitted(S, lane, _V) ->
    to_lane(S);
admitted(S0 = #send{rt = RT = #runtime{large_threshold = T}, lane = L, node = Node, to = Tos,
                    msg = Msg}, entry, V) ->
    %% a multicast entry: through the inbox (to be fanned out there) or the lane
    {Kind, Size} = case convoy_size:measure(Msg, T) of
                       {large, _} = Large -> {large, Large};
                       {small, B} -> {small, {multicast, B}}
                   end,
    S = S0#send{size = Size},
    Idle = idle(RT, L, V),
    Calm = case Kind of
               large -> busy;
               small -> entry_calm(RT, L, Node)
           end,
    {Route, C, Inboxes} = case Idle of
                              true -> multi_row(Node, Tos);
                              false -> {none, undefined, none}
                          end,
    case convoy_path:multicast(Kind, Calm, Idle, Route) of
        inbox -> via_inbox(S, Inboxes, C);
        lane -> to_lane(S)
    end.

%% The one disposal of an admission by the sender (see `admit/2').
dispose(#send{rt = RT, lane = L}) ->
    ok = convoy_slots:dispose(slots(RT, L), 1).

%% The lane has shipped all it was given: the message may follow it, by a path
%% that depends on the node's route. A large message to a peer that reads
%% pieces goes in pieces through the inbox, behind what the lane shipped.
bypass(S = #send{rt = RT, lane = L, node = Node, size = {large, B}}, Calm) ->
    case pieces_inbox(RT, L, Node, B) of
        {Target, C} ->
            ok = dispose(S),
            chunked(S, Target, C);
        none ->
            bypass_by_route(S, Calm)
    end;
bypass(S, Calm) ->
    bypass_by_route(S, Calm).

bypass_by_route(S = #send{rt = RT, lane = L, node = Node, size = Size}, Calm) ->
    {Route, C, Inboxes} = node_row(Node),
    case convoy_path:bypass(size_kind(Size), Calm, Route) of
        direct ->
            %% Plain peer: what the lane shipped is already in the connection.
            unmark(Node),
            admitted_direct(S, C);
        inbox ->
            via_inbox(S, Inboxes, C);
        inbox_barrier ->
            inbox_then_barrier(S, Inboxes, C);
        lane ->
            to_lane(S);
        barrier_direct ->
            %% The lane was idle: what the barrier confirms needs no admission
            %% held across the wait, and a sender killed in it holds none.
            ok = dispose(S),
            case convoy_wait:barrier(RT, L, Node, Inboxes, C, [], none) of
                ok ->
                    unmark(Node),
                    direct_send(RT, L, Node, S#send.to, S#send.msg, Size);
                _TimeoutOrNotSent ->
                    admit(S, lane)
            end
    end.

%% The message goes to the inbox with a barrier behind it, and the sender waits
%% (at most barrier_timeout ms) for the barrier's answer, which comes once the
%% inbox delivered the message and everything before it: the marker goes and the
%% sender's next messages may go directly. The message itself never waits for
%% the barrier: behind a busy connection a barrier costs a whole drain of it, and
%% a barrier first, then the message, waited two. If no answer comes in time the
%% message is on its way all the same; the sender stays marked. The admission is
%% disposed of only after the wait: meanwhile the lane is not idle, so its other
%% senders go through it and their messages form batches (disposed of at once,
%% many request/response pairs lost to `!'). The lane holds it for the wait
%% (`barrier/7', `owed'), so a sender killed meanwhile does not keep it.
inbox_then_barrier(S = #send{rt = RT, lane = L, node = Node, to = To, msg = Msg}, Inboxes, C) ->
    mark(Node),
    case convoy_wait:barrier(RT, L, Node, Inboxes, C, [{To, Msg}], owed) of
        ok ->
            unmark(Node),
            count_direct(C);
        timeout ->
            count_direct(C);
        not_sent ->
            to_lane(S)
    end.

%% The lane holds messages: they go to it, except a large message to a peer that
%% reads pieces, whose sender waits for the lane to ship what it holds for Node
%% (at most barrier_timeout ms) and then sends it in pieces behind that.
busy_lane(S = #send{rt = RT, lane = L, node = Node, size = {large, B}}) ->
    case pieces_inbox(RT, L, Node, B) of
        {Target, C} ->
            ok = dispose(S),
            case convoy_wait:drain(RT, L, Node, C) of
                ok -> chunked(S, Target, C);
                timeout -> admit(S, lane)
            end;
        none ->
            to_lane(S)
    end;
busy_lane(S) ->
    to_lane(S).

size_kind({large, _}) -> large;
size_kind(_) -> small.

%% Plain send straight to the destination, never suspending or connecting; if
%% that is not possible now, the lane takes the message. A large message to a
%% peer that reads pieces goes in pieces instead (nothing of the sender's is in
%% its lane or an inbox).
direct(RT, L, Node, To, Msg, {large, B} = Size) ->
    case pieces_inbox(RT, L, Node, B) of
        {Target, C} -> chunked(context(RT, L, Node, To, Msg, Size), Target, C);
        none -> direct_send(RT, L, Node, To, Msg, Size)
    end;
direct(RT, L, Node, To, Msg, Size) ->
    direct_send(RT, L, Node, To, Msg, Size).

%% A large message in pieces through the lane's inbox (convoy_chunk_send), where
%% the sender's earlier messages to Node are all in the connection already (its
%% admission, if any, disposed of). The sender is marked while it waits;
%% `delivered' (like a barrier's answer) and `refused' (the inbox reached the
%% first piece, so it delivered everything before it) clear the marker.
chunked(S = #send{rt = RT, lane = L, node = Node, to = To, msg = Msg}, Target, C) ->
    mark(Node),
    case convoy_chunk_send:send(RT, Node, Target, C, To, Msg) of
        delivered ->
            unmark(Node),
            count_direct(C);
        sent ->
            %% A wait for the delivery ran out (counted `stalled'): the sender's
            %% next messages must not take another inbox before it (settle/5).
            convoy_wait:ran_out(RT, L, Node, C, piece, timeout_native(RT)),
            set_marker(Node, {pieces, convoy_chunk_send:inbox_name(Target)}),
            count_direct(C);
        refused ->
            unmark(Node),
            direct_send(RT, L, Node, To, Msg, S#send.size);
        no_answer ->
            %% Its first piece may still be waiting: the lane ships it whole,
            %% behind that piece.
            convoy_wait:ran_out(RT, L, Node, C, piece, timeout_native(RT)),
            admit(S, lane);
        dropped ->
            ok
    end.

%% The length of a wait for a piece's answer that ran out.
timeout_native(#runtime{barrier_timeout = T}) ->
    erlang:convert_time_unit(T, millisecond, native).

%% A large message goes in pieces only to a node that answers: pieces wait for
%% answers, and a node marked unanswered gets it whole, as `!' would.
pieces_inbox(RT, L, Node, Bytes) ->
    case convoy_chunk_send:inbox(RT, L, Node, Bytes) of
        {_Target, C} = Pieces ->
            case convoy_metrics:is_unanswered(C) of
                false -> Pieces;
                true -> none
            end;
        none ->
            none
    end.

%% Not admitted: sent now, or the lane takes it (admitted then).
direct_send(RT, L, Node, To, Msg, Size) ->
    case erlang:send(convoy_wire:address(To, Node), Msg, ?DIRECT_OPTS) of
        ok -> count_direct_to(Node);
        _NoSuspendOrNoConnect -> admit(context(RT, L, Node, To, Msg, Size), lane)
    end.

%% Count a direct send with the node's counters, checked by a mark in the
%% counters themselves (`convoy_metrics:add_direct/1'): a row forgotten
%% meanwhile is fetched again.
count_direct_to(Node) ->
    case convoy_metrics:add_direct(element(1, refs(Node))) of
        ok -> ok;
        closed -> erlang:yield(), count_direct_to(Node)
    end.

%% A node's counters and held array (convoy_held), as convoy_peers publishes
%% them (read in place, never copied: `convoy_peers:refs/1'). A row that
%% convoy_peers forgets between this read and their use is closed for good:
%% taking room in it answers `closed' (`hold/3'), and the caller reads the row
%% again (`reheld/1').
refs(Node) ->
    case convoy_peers:refs(Node) of
        {_C, _H} = Refs ->
            Refs;
        undefined ->
            %% No convoy_peers (convoy's tree is being torn down): never crash
            %% the caller; these counts are not kept.
            convoy_metrics:new_refs()
    end.

%% Node's route (convoy, plain, or none before convoy has dealt with Node or while
%% convoy's tree is being torn down), its counters and its inbox names.
node_row(Node) ->
    case convoy_peers:lookup(Node) of
        {{convoy, _Vsn, Inboxes}, C, _H} -> {answering(C), C, Inboxes};
        {plain, C, _H} -> {plain, C, none};
        none -> {none, undefined, none}
    end.

%% A publish entry goes to the inbox only of a peer that reads it; for any other
%% the lane turns it into what the peer reads when it ships.
multi_row(Node, {?TAG_PUBLISH, _Scope, _Group}) ->
    case convoy_peers:lookup(Node) of
        {{convoy, Vsn, Inboxes}, C, _H} ->
            case convoy_wire:supports(Vsn, publish) of
                true -> {answering(C), C, Inboxes};
                false -> {none, undefined, none}
            end;
        _ ->
            {none, undefined, none}
    end;
multi_row(Node, _Tos) ->
    node_row(Node).

%% A convoy peer's route: `unanswered' while a wait for its answer that ran out
%% has not been followed by an answer (see `convoy_metrics:unanswered/2').
answering(C) ->
    case convoy_metrics:is_unanswered(C) of
        false -> convoy;
        true -> unanswered
    end.

admitted_direct(S = #send{node = Node, to = To, msg = Msg}, C) ->
    case erlang:send(convoy_wire:address(To, Node), Msg, ?DIRECT_OPTS) of
        ok -> disposed(S, C);
        _NoSuspendOrNoConnect -> to_lane(S)
    end.

%% A batch of one to the inbox this sender's lane uses (a multicast entry's
%% `to' is its list of destinations on the node).
via_inbox(S = #send{lane = L, node = Node, to = To, msg = Msg}, Inboxes, C) ->
    case to_inbox(L, Node, Inboxes, [wire_entry({To, Msg})]) of
        ok -> disposed(S, C);
        _ -> to_lane(S)
    end.

%% Entries as one batch to the inbox lane L ships to on Node, never suspending,
%% the node marked (rule 3: they may wait in that inbox): ok, or not sent.
to_inbox(L, Node, Inboxes, Entries) ->
    mark(Node),
    erlang:send({convoy_wire:lane_inbox(L, Inboxes), Node}, convoy_wire:batch(node(), Entries),
                ?DIRECT_OPTS).

wire_entry({{?TAG_PUBLISH, Scope, Group}, Msg}) -> convoy_wire:publish(Scope, Group, Msg);
wire_entry(Entry) -> Entry.

%% Sent by the sender itself: disposed of, and counted.
disposed(S, C) ->
    ok = dispose(S),
    count_direct(C).

count_direct(C) ->
    convoy_metrics:add(C, direct, 1).

%% Hand an admitted message to the lane, within the node's bounds (max_buffered
%% messages and max_buffered_bytes held by convoy for it, lane mailbox included).
%% When full, the overload policy decides; a message that does not go to the lane
%% has its admission disposed of here. Large messages are tagged: the lane never
%% ships them in a batch with small ones (see convoy_batch).
to_lane(S = #send{rt = RT, node = Node, size = Size}) ->
    {_Kind, Bytes} = kind(Size),
    {C, H} = refs(Node),
    case hold(RT, H, Bytes) of
        ok -> hand_over(S);
        full -> overloaded(S, C, H);
        closed -> reheld(S)
    end.

%% The row was forgotten (or is being checked by convoy_peers right now: let it
%% finish): to_lane/1 reads the node's row again.
reheld(S) ->
    erlang:yield(),
    to_lane(S).

kind({small, B}) -> {?TAG_SEND, B};
kind({multicast, B}) -> {?TAG_MULTICAST, B};
kind({large, B}) -> {?TAG_LARGE, B}.

hand_over(#send{rt = #runtime{lanes = Lanes}, lane = L, node = Node, to = To, msg = Msg,
                size = Size}) ->
    {Kind, Bytes} = kind(Size),
    mark_lane(Node),
    erlang:send(element(L, Lanes), {Kind, Node, To, Msg, Bytes}),
    ok.

%% `to_lane/1' for a small message of Bytes of a marked sender (already
%% marked) once its room was asked for (`hold/3', `convoy_held:hold_behind/4'):
%% its context made only if the lane does not take it at once (the node's bound
%% reached, or its row forgotten).
held_to_lane(ok, #runtime{lanes = Lanes}, L, Node, To, Msg, Bytes, _C, _H) ->
    erlang:send(element(L, Lanes), {?TAG_SEND, Node, To, Msg, Bytes}),
    ok;
held_to_lane(full, RT, L, Node, To, Msg, Bytes, C, H) ->
    overloaded(context(RT, L, Node, To, Msg, {small, Bytes}), C, H);
held_to_lane(closed, RT, L, Node, To, Msg, Bytes, _C, _H) ->
    reheld(context(RT, L, Node, To, Msg, {small, Bytes})).

%% Take room for one message of Bytes within the node's bounds (convoy_held).
hold(#runtime{max_buffered = MaxN, max_buffered_bytes = MaxB}, H, Bytes) ->
    convoy_held:hold(H, Bytes, MaxN, MaxB).

overloaded(S = #send{rt = #runtime{overload = block, block_timeout = Timeout}}, C, H) ->
    case convoy_metrics:may_wait_for_room(C) of
        true -> block(S, C, H, Timeout);
        false -> refuse(S, C)
    end;
overloaded(S = #send{rt = RT = #runtime{overload = drop}}, C, _H) ->
    refuse(S#send{rt = RT#runtime{refuse = drop}}, C);
overloaded(S = #send{rt = #runtime{overload = error}}, C, _H) ->
    refuse(S, C).

%% Wait for room at most Timeout ms. The admission is disposed of before the wait
%% and taken again once room is found (`readmitted/4'): the message is in no lane
%% meanwhile, so whether the lane is idle does not matter to it, and a sender
%% killed while it waits holds none. A wait that runs out marks the node, and a
%% wait under way gives up as soon as the node does not answer its lane's probe
%% (`convoy_wait:room/7'), so a stall costs a sender one wait, not one per
%% message.
block(S = #send{rt = RT, lane = L, node = Node, size = Size}, C, H, Timeout) ->
    ok = dispose(S),
    {_Kind, Bytes} = kind(Size),
    case convoy_wait:room(RT, L, Node, C, H, Bytes, Timeout) of
        {ok, Deadline} -> readmitted(S, H, Bytes, Deadline);
        {closed, _} -> admit(S, lane); % the row was forgotten: to_lane/1 fetches it again
        {_TimeoutOrUnanswered, _} -> refused(RT, C)
    end.

%% Room was taken for the message: it is admitted again and handed to the lane; on
%% a closed lane (retired or stopping meanwhile) the room is given back and the
%% message starts again under the new runtime, within what is left of its wait.
readmitted(S = #send{rt = RT, lane = L}, H, Bytes, Deadline) ->
    case admission(RT, L) of
        closed ->
            ok = convoy_held:release(H, 1, Bytes),
            Left = erlang:convert_time_unit(max(0, Deadline - erlang:monotonic_time()), native,
                                            millisecond),
            restart(S#send{rt = RT#runtime{block_timeout = Left}});
        _V ->
            hand_over(S)
    end.

%% Not sent: the admission disposed of, counted as dropped (send/2, or policy
%% drop) or refused (send/3).
refuse(S = #send{rt = RT}, C) ->
    ok = dispose(S),
    refused(RT, C).

refused(#runtime{refuse = drop}, C) ->
    convoy_metrics:add(C, accepted, 1),
    convoy_metrics:add(C, dropped, 1),
    ok;
refused(#runtime{refuse = error}, C) ->
    convoy_metrics:add(C, refused, 1),
    {error, overload}.

%% The lane has disposed of every admission before ours (V). With max_delay set
%% the user asked for batches: never bypass the lane then.
idle(RT = #runtime{max_delay = 0}, L, V) -> convoy_slots:idle(slots(RT, L), V);
idle(_RT, _L, _V) -> false.

%% A multicast entry's small send to `Node': recorded on the lane as one send
%% (an entry reuses no calm and leaves the sender's reuse as it is), and how calm
%% the lane was before it (convoy_path). Where batching is forced (`max_delay'
%% set, or `bypass_after' `never') the lane is never calm and only the time is
%% noted (`forced/2').
entry_calm(RT = #runtime{bypass_after = never}, L, _Node) ->
    forced(RT, L);
entry_calm(RT = #runtime{max_delay = D}, L, _Node) when D > 0 ->
    forced(RT, L);
entry_calm(RT, L, Node) ->
    Now = now_us(RT),
    {OwnGap, Own} = convoy_path:entry_record(own(), Node, Now),
    put(?OWN_KEY, Own),
    calm(RT, L, Now, OwnGap, 1, direct).

%% The same at `Now', with the sender's own gap per send already known. How long
%% the lane has been without a small message depends on where the sender's
%% unrecorded sends went: `direct' (an unmarked sender's reused calm), so the
%% lane's gap since its last record counts per send; or `lane' (a marked
%% sender's skipped records), so its own previous send took the lane at the
%% latest `OwnGap' ago, as if it had been recorded.
calm(RT = #runtime{bypass_after = W}, L, Now, OwnGap, Sends, Unrecorded) ->
    Slots = slots(RT, L),
    {LaneGap, Gaps} = convoy_slots:since_last_send(Slots, Now, OwnGap, Sends),
    Gap = case Unrecorded of
              direct -> LaneGap div Sends;
              lane -> min(LaneGap, OwnGap)
          end,
    case convoy_path:calm(Gap, W) of
        busy ->
            case convoy_path:streams(OwnGap, W) of
                true ->
                    busy;
                false ->
                    convoy_path:pays(convoy_slots:unpaid_until(Slots), Now, gaps(Slots, Gaps))
            end;
        quiet ->
            convoy_path:quiet(convoy_slots:unpaid_until(Slots), gaps(Slots, Gaps));
        Settled ->
            Settled
    end.

%% The gaps as this send updated them, or as the lane holds them.
gaps(Slots, unread) -> convoy_slots:recent_gaps(Slots);
gaps(_Slots, Gaps) -> Gaps.

own() ->
    case get(?OWN_KEY) of
        undefined -> convoy_path:own();
        Own -> Own
    end.

%% An unmarked sender that found its lane calm takes that calm as found for its
%% next CALM_REUSE small sends: they go directly without the clock or the lane's
%% shared line (on a node idle between messages, those were most of what convoy
%% added to a send). A direct send is always safe for an unmarked sender. The
%% next recorded send stands for the sends taken since the last one: its gaps
%% count per send, so a sender that starts to stream, or many that take turns,
%% are seen as before. (A reuse cut short by the sender's marking is counted at
%% its next unmarked record, once, which only makes that sample look busier.)
unmarked_calm(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node) when is_integer(W) ->
    case get(?OWN_KEY) of
        undefined -> first_calm(RT, L, Node);
        Own0 -> unmarked_calm(RT, L, Node, Own0)
    end;
unmarked_calm(RT, L, _Node) ->
    forced(RT, L).

%% A process's first small send: while convoy holds messages for the node (its
%% lanes are in use), it takes the lane as busy without reading the lane's calm
%% or keeping any state for its next sends. Most processes whose first send finds
%% the node busy send once (the seed's flood of fresh pingers), and that state
%% would die with them; one that goes on streams into its lane, marked.
first_calm(RT, L, Node) ->
    {_C, H} = refs(Node),
    case convoy_held:is_empty(H) of
        false -> busy;
        true -> unmarked_calm(RT, L, Node, convoy_path:own())
    end.

unmarked_calm(RT, L, Node, Own0) ->
    case convoy_path:reuse(Own0) of
        {Calm, Own} ->
            put(?OWN_KEY, Own),
            Calm;
        record ->
            Now = now_us(RT),
            {OwnGap, Sends, Own} = convoy_path:unmarked_record(Own0, Node, Now),
            Calm = calm(RT, L, Now, OwnGap, Sends, direct),
            put(?OWN_KEY, convoy_path:found(Own, Calm)),
            Calm
    end.

%% A marked sender records at most one small send in SKIP_MAX + 1 on its lane,
%% the recorded one standing for the skipped ones in the lane's averages (as an
%% unmarked sender's do): a send while its lane holds messages skips without
%% reading the clock (`skipped_record/3'), and on an idle lane a sender that
%% streams (its own sends, on average since its last record, within
%% `bypass_after') keeps the lane without recording (`marked_calm/3'). So a
%% flood's sender reads the clock and writes the lane's shared line rarely, and
%% the lane's last small send, which tells other senders and large messages that
%% the lane is in use, stays at most SKIP_MAX + 1 of its sends old.
marked_calm(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node) when is_integer(W) ->
    Now = now_us(RT),
    case convoy_path:marked_record(own(), skipped(), Node, Now, W) of
        {skip, Skipped} ->
            put(?SKIPPED_KEY, Skipped),
            busy;
        {record, OwnGap, Sends, Own} ->
            put(?OWN_KEY, Own),
            _ = Sends =:= 1 orelse erase(?SKIPPED_KEY),
            calm(RT, L, Now, OwnGap, Sends, lane)
    end;
marked_calm(RT, L, _Node) ->
    forced(RT, L).

%% A marked sender's small send to its busy lane (the path does not depend on
%% the lane's calm). A sender that its last clock reading found streaming
%% (`marked_calm/3' started counting skips) skips this one's clock and record
%% too, up to SKIP_MAX in a row; any other sender records it as before: the
%% lane's last small send and averages stay as fresh as its senders' traffic,
%% which the calm of every other sender on the lane reads.
skipped_record(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node) when is_integer(W) ->
    case convoy_path:skip(get(?SKIPPED_KEY)) of
        {skip, Skipped} ->
            put(?SKIPPED_KEY, Skipped),
            ok;
        record ->
            _ = marked_calm(RT, L, Node),
            ok
    end;
skipped_record(RT, L, _Node) ->
    busy = forced(RT, L),
    ok.

skipped() ->
    case get(?SKIPPED_KEY) of
        undefined -> 0;
        N -> N
    end.

%% Batching forced: the lane is never calm, and no average is read. The small
%% send's time is noted all the same: a large message that follows goes in
%% pieces behind it (convoy_path:pieces/3).
forced(RT, L) ->
    ok = convoy_slots:note_small_send(slots(RT, L), now_us(RT)),
    busy.

now_us(#runtime{clock = Clock}) -> convoy_slots:now_us(Clock).

%% One multicast entry to a remote node: one copy travels, the inbox fans it out.
%% A large one (large_threshold) never waits in the lane when the lane is idle: the
%% sender ships it to the inbox itself, behind everything the lane shipped, so it is
%% copied no more than a send copies it.
remote_multi(undefined, Node, Tos, Msg) ->
    after_pieces(undefined, Node, wire_entry({Tos, Msg}),
                 fun() -> plain_send(Node, Tos, Msg) end);
remote_multi(RT = #runtime{stopping = true}, Node, Tos, Msg) ->
    after_pieces(RT, Node, wire_entry({Tos, Msg}), fun() -> stopping(RT, Node, Tos, Msg) end);
remote_multi(RT, Node, Tos, Msg) ->
    L = lane_of(RT),
    case marker(Node) of
        {pieces, Inbox} ->
            case lane_inbox(L, Node) of
                Inbox -> multi(RT, L, Node, Tos, Msg);
                _Other -> settle(RT, Node, Inbox, wire_entry({Tos, Msg}),
                                 fun() -> multi(RT, L, Node, Tos, Msg) end)
            end;
        _ ->
            multi(RT, L, Node, Tos, Msg)
    end.

multi(RT, L, Node, Tos, Msg) ->
    admit(#send{rt = RT, lane = L, node = Node, to = Tos, msg = Msg, entry = true}, entry).

%%--------------------------------------------------------------------
%% After a message in pieces whose delivery was not confirmed
%%
%% Its pieces went to the peer's inbox `Inbox' from this process; the inbox may
%% still be reassembling it. Rule 1 keeps the sender's next messages behind it as
%% long as they go through the same inbox; when they would not (`lanes' changed,
%% or convoy stops or stopped, and the sender then sends plainly), the sender
%% first confirms `Inbox': a barrier from this process to it is answered only once
%% it delivered the pieces before it (same sender, same receiver). Without an
%% answer, the message goes to `Inbox' itself, behind the pieces, and the
%% marker stays; a node marked unanswered is not waited for again. That send is
%% behind everything the sender sent since only because all of it went straight
%% to `Inbox': a message handed to the lane ends the marker (`mark_lane/1'), and
%% the lane's own confirmations then cover the pieces.

after_pieces(RT, Node, Entry, Next) ->
    case marker(Node) of
        {pieces, Inbox} -> settle(RT, Node, Inbox, Entry, Next);
        _ -> Next()
    end.

settle(RT, Node, Inbox, Entry, Next) ->
    case convoy_wait:confirm(RT, settle_lane(RT), Node, Inbox, node_counters(Node)) of
        ok ->
            case RT of
                undefined -> unmark(Node); % nothing of convoy's is left to wait for
                _ -> set_marker(Node, true)
            end,
            Next();
        _TimeoutOrNotSent ->
            behind_pieces(RT, Node, Inbox, Entry, Next)
    end.

%% The caller's lane, which probes the node if the confirm runs out; with convoy
%% not running nothing is counted or probed, and any index does.
settle_lane(undefined) -> 1;
settle_lane(RT) -> lane_of(RT).

%% The message follows the pieces through their inbox: without waiting (never
%% suspending) while convoy runs, as a plain send would once it stopped. A full
%% connection to a node that does not answer is overload: refused at once and
%% counted. Not connected: the pieces went with the connection, nothing is left
%% to follow.
behind_pieces(RT, Node, Inbox, Entry, Next) ->
    Opts = case RT of
               undefined -> [noconnect];
               _ -> ?DIRECT_OPTS
           end,
    case erlang:send({Inbox, Node}, convoy_wire:batch(node(), [Entry]), Opts) of
        ok when RT =:= undefined ->
            ok;
        ok ->
            count_direct_to(Node);
        nosuspend ->
            refuse_behind_pieces(RT, node_counters(Node));
        noconnect ->
            unmark(Node),
            Next()
    end.

refuse_behind_pieces(_RT, undefined) ->
    ok;
refuse_behind_pieces(RT, C) ->
    refused(RT, C).

%% The inbox lane L ships to on Node now (`none' when Node is not a convoy peer).
lane_inbox(L, Node) ->
    case convoy_peers:lookup(Node) of
        {{convoy, _Vsn, Inboxes}, _C, _H} -> convoy_wire:lane_inbox(L, Inboxes);
        _ -> none
    end.

%% Node's counters if it has a row (none is created here).
node_counters(Node) ->
    case convoy_peers:lookup(Node) of
        {_Route, C, _H} -> C;
        none -> undefined
    end.

%%--------------------------------------------------------------------
%% convoy not running, or stopping

%% Plain sends, as when convoy is not running.
plain_send(Node, {?TAG_PUBLISH, Scope, Group}, Msg) ->
    plain_send(Node, convoy_pg:members_on(Scope, Group, Node), Msg);
plain_send(Node, Tos, Msg) ->
    lists:foreach(fun(To) -> erlang:send(convoy_wire:address(To, Node), Msg) end, Tos),
    ok.

%% convoy is stopping: its lanes are closed and drain. A sender whose earlier
%% messages to Node went through its lane or an inbox waits until its lane is gone
%% (everything it held shipped and confirmed delivered by the peer's inbox, or
%% counted as dropped), so that its plain sends cannot overtake them.
stopping(RT, Node, Tos, Msg) ->
    case is_marked(Node) of
        false ->
            ok;
        true ->
            convoy_wait:await_gone(element(lane_of(RT), RT#runtime.lanes)),
            unmark(Node)
    end,
    plain_send(Node, Tos, Msg).
