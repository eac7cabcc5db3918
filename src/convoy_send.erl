%% @private
%% One remote message (or multicast entry, or `send_many/1''s messages for
%% several nodes) on its way: runs in the caller's process, gathers the facts,
%% asks `convoy_path' for the path and carries it out.
%%
%% Ordering rests on three rules.
%% <ol>
%% <li>A sender always uses the same lane for a node: each node has lanes of its
%%   own (`convoy_lanes'), and the sender's is the one at `phash2(self(), Lanes)'
%%   among them. A lane ships its node's queue in order, always to the same inbox
%%   of that node, and the inbox delivers batches in arrival order.</li>
%% <li>A sender may bypass its lane only when the lane is idle: every admission to the
%%   lane has been disposed of. Then everything the sender handed over before is
%%   already in the distribution connection, which delivers in order what it was
%%   given in order; the sender's own message goes in behind it. For a small
%%   message the lane must also be calm (`convoy_sender', `convoy_path'): a flood
%%   is batched instead of leaking out one message at a time, while a lone
%%   request/response pays no extra hop. Calm changes which of the safe paths is
%%   taken, never the rules.</li>
%% <li>Bypassing the inbox too (sending straight to the destination process) is
%%   allowed only when none of the sender's earlier messages to that node can still
%%   be waiting in an inbox: the sender's marker for the node (`convoy_sender')
%%   says its traffic went through a lane or an inbox since its last barrier. A
%%   barrier (an entry the inbox answers once everything before it is delivered)
%%   clears it.</li>
%% </ol>
%%
%% The admission bracket (`bracket/5'): every message that may touch the lane is
%% admitted there, once, and its admission ends there, once: handed to the lane
%% (which disposes of it when it ships the message), or disposed of by the
%% sender before anything that may wait (a barrier, the lane's drain, room in
%% the bound, a message in pieces). A path that must start over after its wait
%% enters the bracket again. So a sender killed in any wait holds no admission,
%% except a barrier behind its own message to the inbox, which the lane takes
%% over for the wait (`convoy_wait:barrier/7'). The accounting is checked by a
%% PropEr model on live nodes (test/convoy_accounting_SUITE.erl).
%%
%% When convoy stops, the runtime is published marked `stopping' and every lane is
%% closed: a marked sender waits until its lane is gone (everything it held
%% shipped and confirmed), then sends plainly, so plain sends never overtake
%% convoy's.
-module(convoy_send).

-export([send/3, remote/4, entry/4, entry/5, entry_size/2, together/2]).

-export_type([entry_size/0]).

%% An entry message's measured size (`none' where it is not measured: convoy not
%% running or stopping).
-type entry_size() :: {multicast | large, non_neg_integer()} | none.

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").

-define(DIRECT_OPTS, [nosuspend, noconnect]).

%% One message or multicast entry: the runtime with the call's options, the
%% sender's lane, the node, the destination there (an entry's list of them, or a
%% `pg' group), the message, its encoded size once measured
%% (`{small | multicast | large, Bytes}'), and whether it is an entry.
-record(send, {rt :: #runtime{},
               lane :: pos_integer(),
               node :: node(),
               to :: term(),
               msg :: term(),
               size :: {small | multicast | large, non_neg_integer()},
               entry = false :: boolean()}).

%% `send_many/1''s small messages for several nodes, `count' in all, admitted
%% together: `{Node, Entries, Bytes, {Node, Tos}}' per node.
-record(many, {rt :: #runtime{},
               lane :: pos_integer(),
               nodes :: [{node(), list(), non_neg_integer(), {node(), list()}}],
               count :: pos_integer()}).

%% The bracket and a flood's path through it are inlined: every message of a
%% flood takes them (measured: reductions per send, `bin/convoy-bench cost').
-compile({inline, [slots/2, size_kind/1, idle/3, context/6, count_direct/1, hold/3,
                   bracket/2, bracket/5, job/3, carry_out/5, carry_out/3, held/4]}).

%%--------------------------------------------------------------------
%% One message

%% @doc `send/2''s message to `To' on `Node': under the node's runtime when it is
%% connected (found in the settings' runtime), else as `remote/4'.
-spec send(node(), term(), term()) -> ok.
send(Node, To, Msg) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{stopping = false, rows = #{Node := Row}} -> sending(Row, Node, To, Msg);
        RT -> remote(RT, Node, To, Msg)
    end.

%% @doc One message to `To' on `Node' under the runtime `RT' (`undefined' when
%% convoy is not running) and its options: `ok', or `{error, overload}' when
%% `send/3' is refused.
-spec remote(#runtime{} | undefined, node(), term(), term()) -> ok | {error, overload}.
remote(undefined, Node, To, Msg) ->
    after_pieces(undefined, Node, {To, Msg}, fun() -> plain_send(Node, [To], Msg) end);
remote(RT = #runtime{stopping = true}, Node, To, Msg) ->
    after_pieces(RT, Node, {To, Msg}, fun() -> stopping(Node, [To], Msg) end);
remote(RT, Node, To, Msg) ->
    case convoy_lanes:runtime(RT, Node) of
        Row = #runtime{stopping = false} -> sending(Row, Node, To, Msg);
        StoppingOrNot -> remote(StoppingOrNot, Node, To, Msg)
    end.

%% A message under its node's runtime (`Row'), convoy running.
sending(RT = #runtime{large_threshold = T, lanes = Lanes}, Node, To, Msg) ->
    L = convoy_lanes:lane_of(RT),
    Bytes = convoy_size:bytes(Msg), % measured once
    case convoy_sender:marked(Node, Lanes) of
        {_Lanes, _C, _H} = Refs ->
            %% marked and streaming, the node's row kept: a flood's every send
            streaming(RT, L, Node, To, Msg, Bytes, Refs);
        Marker ->
            by_marker(Marker, RT, L, Node, To, Msg, convoy_size:sized(Bytes, T))
    end.

%% A streaming sender's message, the node's row kept (`Refs'). A small one's job
%% is the lane's message itself, the runtime and the lane beside it: a flood's
%% send makes that term and no other (each term a sender makes brings its next
%% garbage collection nearer); its context is made only if it leaves the
%% flood's path (`job/3').
streaming(RT = #runtime{large_threshold = T}, L, Node, To, Msg, Bytes, Refs) ->
    case convoy_size:is_small(Bytes, T) of
        true -> bracket({?TAG_SEND, Node, To, Msg, Bytes}, Refs, RT, L, 1);
        false -> by_marker(true, RT, L, Node, To, Msg, convoy_size:sized(Bytes, T))
    end.

%% Any other message, by the sender's marker for its node.
by_marker(false, RT, L, Node, To, Msg, Size) ->
    unmarked(RT, L, Node, To, Msg, Size);
by_marker(true, RT, L, Node, To, Msg, Size) ->
    bracket(context(RT, L, Node, To, Msg, Size), marked);
by_marker({pieces, Inbox}, RT, L, Node, To, Msg, Size) ->
    %% off a flood's path: a message handed to the lane here ends the marker
    %% (`hand_over/1')
    S = context(RT, L, Node, To, Msg, Size),
    case convoy_row:lane_inbox(L, Node) of
        Inbox -> after_marked(S);
        _Other -> settle(RT, Node, Inbox, {To, Msg}, fun() -> after_marked(S) end)
    end.

after_marked(S = #send{rt = RT, lane = L, node = Node, size = Size}) ->
    Calm = case Size of
               {large, _} -> busy;
               _ -> convoy_sender:marked_calm(RT, L, Node)
           end,
    bracket(S, {calm, Calm}).

%% An unmarked sender's message: a large one, or a small one on a calm lane,
%% goes directly with no admission (nothing of the sender's can be waiting
%% anywhere); the context of that path is made only if it fails.
unmarked(RT, L, Node, To, Msg, Size) ->
    Calm = case Size of
               {large, _} -> busy; % not a small send: the lane's calm is not touched
               _ -> convoy_sender:unmarked_calm(RT, L, Node)
           end,
    case Calm of
        {held, C, H} ->
            %% a first send while the node has messages held: the lane
            bracket(context(RT, L, Node, To, Msg, Size), {held, C, H});
        _ ->
            case convoy_path:unadmitted(size_kind(Size), Calm, false) of
                direct -> direct(RT, L, Node, To, Msg, Size);
                admit -> bracket(context(RT, L, Node, To, Msg, Size), {calm, Calm})
            end
    end.

context(RT, L, Node, To, Msg, Size) ->
    #send{rt = RT, lane = L, node = Node, to = To, msg = Msg, size = Size}.

%% A job as the paths after the admission take it: a streaming sender's
%% (`streaming/7') as any other send's.
job({?TAG_SEND, Node, To, Msg, Bytes}, RT, L) ->
    context(RT, L, Node, To, Msg, {small, Bytes});
job(Job, _RT, _L) ->
    Job.

%% Unadmitted: in pieces to a peer that reads them, else sent now; if the
%% connection is busy or down, the lane takes it.
direct(RT, L, Node, To, Msg, {large, B} = Size) ->
    case pieces_inbox(RT, L, Node, B) of
        {Target, C} -> chunked(context(RT, L, Node, To, Msg, Size), Target, C);
        none -> direct_send(context(RT, L, Node, To, Msg, Size))
    end;
direct(RT, L, Node, To, Msg, Size) ->
    case erlang:send(convoy_wire:address(To, Node), Msg, ?DIRECT_OPTS) of
        ok -> convoy_row:count_direct(Node);
        _NoSuspendOrNoConnect -> bracket(context(RT, L, Node, To, Msg, Size), lane)
    end.

direct_send(S = #send{node = Node, to = To, msg = Msg}) ->
    case erlang:send(convoy_wire:address(To, Node), Msg, ?DIRECT_OPTS) of
        ok -> convoy_row:count_direct(Node);
        _NoSuspendOrNoConnect -> bracket(S, lane)
    end.

%%--------------------------------------------------------------------
%% The admission bracket

%% @doc `send_many/1''s small messages for `Nodes' (`{Node, Entries, Bytes,
%% {Node, Tos}}', the lane's sends newest first), admitted together: on an idle
%% lane each node's messages go straight to the inbox the lane ships to as one
%% batch, else to the lane in one hand-over for every node with room for all its
%% messages. Returns the groups left to send one by one, or to send again under
%% the runtime republished by a lane change or a stop (the lane was closed).
-spec together(#runtime{}, [{node(), list(), non_neg_integer(), {node(), list()}}]) ->
          [{node(), list()}] | {again, [{node(), list()}], [{node(), list()}]}.
together(RT, Nodes) ->
    together(RT, Nodes, [], []).

%% Each node's messages under its own runtime and lane.
together(_RT, [], [], Left) ->
    lists:append(lists:reverse(Left));
together(_RT, [], Again, Left) ->
    {again, lists:append(lists:reverse(Again)), lists:append(lists:reverse(Left))};
together(RT, [{Node, _, _, Group} = G | Rest], Again, Left) ->
    case convoy_lanes:runtime(RT, Node) of
        Row = #runtime{stopping = false} ->
            case bracket(#many{rt = Row, lane = convoy_lanes:lane_of(Row), nodes = [G],
                               count = count([G])}, together) of
                {again, Groups} -> together(RT, Rest, [Groups | Again], Left);
                Groups -> together(RT, Rest, Again, [Groups | Left])
            end;
        _StoppingOrStopped ->
            together(RT, Rest, [[Group] | Again], Left) % sent again, one by one
    end.

%% The one admission of a message (or of `send_many/1''s messages) and the one
%% place where the sender ends it: `bracket/5', for a job, the plan decided
%% before the admission, the runtime, the lane and how many admissions.
%% `carry_out/5' never disposes: it returns how many admissions the
%% lane took over and what is left to do, which runs after the others are
%% disposed of (a wait, a message in pieces, a start over through the bracket).
%% On a closed lane (retired or stopping; its successor is already published)
%% the message starts again.
bracket(S = #send{rt = RT, lane = L}, Plan) ->
    bracket(S, Plan, RT, L, 1);
bracket(M = #many{rt = RT, lane = L, count = K}, Plan) ->
    bracket(M, Plan, RT, L, K).

bracket(Job, Plan, RT, L, K) ->
    Slots = slots(RT, L),
    V = convoy_slots:admit_many(Slots, K),
    case convoy_slots:is_closed(V) of
        true ->
            again(job(Job, RT, L), Plan);
        false ->
            case carry_out(Job, Plan, V, RT, L) of
                {K, ok} ->
                    ok; % all handed to the lane (a flood's every message)
                {Handed, Then} ->
                    ok = convoy_slots:dispose(Slots, K - Handed),
                    then(job(Job, RT, L), Then)
            end
    end.

%% What an admitted job does now: `{Handed, Then}'.
carry_out({?TAG_SEND, Node, _To, _Msg, Bytes} = Handed, {_Lanes, C, H}, V,
          RT = #runtime{lanes = Lanes, max_buffered = MaxN, max_buffered_bytes = MaxB}, L) ->
    %% A streaming sender's small message (every message of a flood): handed
    %% over while the node has messages held, as `marked_held/6' would.
    case convoy_held:hold_behind(H, Bytes, MaxN, MaxB) of
        ok ->
            convoy_sender:held_record(streaming, RT, L, Node, V),
            erlang:send(element(L, Lanes), Handed),
            {1, ok};
        Other ->
            marked_held(Other, job(Handed, RT, L), C, H, streaming, V)
    end;
carry_out(Job, Plan, V, _RT, _L) ->
    carry_out(Job, Plan, V).

carry_out(S = #send{rt = #runtime{lanes = Lanes, max_buffered = MaxN, max_buffered_bytes = MaxB},
                    node = Node, size = {small, Bytes}}, marked, V) ->
    {_Lanes, C, H} = convoy_row:held_refs(Lanes, Node),
    marked_held(convoy_held:hold_behind(H, Bytes, MaxN, MaxB), S, C, H, unread, V);
carry_out(S = #send{rt = RT, size = {small, Bytes}}, {held, C, H}, _V) ->
    case hold(RT, H, Bytes) of
        ok -> hand_over(S);
        Other -> held(Other, S, C, H)
    end;
carry_out(S, marked, V) ->
    calm_path(S, busy, V); % a large one
carry_out(S, {calm, Calm}, V) ->
    calm_path(S, Calm, V);
carry_out(S = #send{}, lane, _V) ->
    to_lane(S);
carry_out(S, {room, _H, _Bytes, _Deadline}, _V) ->
    %% room was taken for it while it held no admission
    hand_over(S);
carry_out(S, entry, V) ->
    entry_path(S, V);
carry_out(#many{nodes = Nodes, rt = RT, lane = L, count = K}, together, V) ->
    case may_bypass_many(RT) andalso idle(RT, L, V - K + 1) of
        true -> {0, {inbox, Nodes}}; % the batches need no admission
        false -> hand_over_many(RT, L, Nodes)
    end;
carry_out(#many{rt = RT, lane = L, nodes = Nodes}, lane, _V) ->
    hand_over_many(RT, L, Nodes).

%% A marked sender's small message, the node's row as kept, its room asked for
%% (`convoy_held:hold_behind/4'): while anything is held for the node the lane
%% is busy without reading it (the read that takes the message's room answers
%% it); else the lane's calm decides.
marked_held(empty, S = #send{rt = RT, lane = L, node = Node, size = {small, Bytes}}, C, H,
            _Known, V) ->
    Calm = convoy_sender:unheld_calm(RT, L, Node, idle(RT, L, V), V),
    case convoy_path:may_bypass(small, Calm) of
        true ->
            Row = convoy_row:read(Node),
            perform(S, convoy_path:decide(small, Calm, element(1, Row), false), Row, none);
        false ->
            held(hold(RT, H, Bytes), S, C, H)
    end;
marked_held(Held, S = #send{rt = RT, lane = L, node = Node}, C, H, Known, V) ->
    convoy_sender:held_record(Known, RT, L, Node, V),
    held(Held, S, C, H).

%% An admitted message whose sender found the lane's calm: the lane's view and
%% whether a large one goes in pieces, then `convoy_path:decide/4'.
calm_path(S = #send{rt = RT, lane = L, node = Node, size = Size}, Calm, V) ->
    Kind = size_kind(Size),
    Pieces = case Size of
                 {large, B} -> pieces_inbox(RT, L, Node, B);
                 _ -> none
             end,
    Row = case convoy_path:may_bypass(Kind, Calm) andalso idle(RT, L, V) of
              true -> convoy_row:read(Node);
              false -> {busy, undefined, none}
          end,
    perform(S, convoy_path:decide(Kind, Calm, element(1, Row), Pieces =/= none), Row, Pieces).

%% What is left once the admissions the lane did not take are disposed of.
then(_Job, ok) ->
    ok;
then(_Job, {error, overload} = Refused) ->
    Refused;
then(S = #send{rt = RT, lane = L, node = Node}, {barrier, C, Inboxes}) ->
    case convoy_wait:barrier(RT, L, Node, Inboxes, C, [], none) of
        ok ->
            convoy_sender:unmark(Node),
            direct_send(S);
        _TimeoutOrNotSent ->
            bracket(S, lane)
    end;
then(S, {pieces, Target, C}) ->
    chunked(S, Target, C);
then(S = #send{rt = RT, lane = L, node = Node}, {drain, Target, C}) ->
    case convoy_wait:drain(RT, L, Node, C) of
        ok -> chunked(S, Target, C);
        timeout -> bracket(S, lane)
    end;
then(S = #send{rt = RT = #runtime{block_timeout = Timeout}, lane = L, node = Node},
     {room, C, H, Bytes}) ->
    case convoy_wait:room(RT, L, Node, C, H, Bytes, Timeout) of
        {ok, Deadline} -> bracket(S, {room, H, Bytes, Deadline});
        {closed, _} -> bracket(S, lane); % the row was forgotten: to_lane/1 fetches it again
        {_TimeoutOrUnanswered, _} -> refused(RT, C)
    end;
then(#many{rt = RT, lane = L, nodes = Nodes}, {inbox, Nodes}) ->
    %% encoded only now, holding no admission (a large batch takes long); the
    %% nodes the inbox did not take are admitted again for the hand-over
    case [G || G <- Nodes, not via_inbox_many(RT, L, G)] of
        [] -> [];
        ToLane -> bracket(#many{rt = RT, lane = L, nodes = ToLane,
                                count = count(ToLane)}, lane)
    end;
then(#many{}, {left, Left}) ->
    Left.

%% The lane was closed: the job starts again under the runtime republished by a
%% lane change or a stop (room taken for a message is given back first, and the
%% message keeps what is left of its wait).
again(S = #send{rt = RT}, {room, H, Bytes, Deadline}) ->
    ok = convoy_held:release(H, 1, Bytes),
    Left = erlang:convert_time_unit(max(0, Deadline - erlang:monotonic_time()), native,
                                    millisecond),
    restart(S#send{rt = RT#runtime{block_timeout = Left}});
again(S = #send{}, _Plan) ->
    restart(S);
again(#many{nodes = Nodes}, _Plan) ->
    {again, [Group || {_Node, _Entries, _Bytes, Group} <- Nodes]}.

restart(#send{rt = RT, node = Node, to = Tos, msg = Msg, entry = true}) ->
    entry(refreshed(RT), Node, Tos, Msg);
restart(#send{rt = RT, node = Node, to = To, msg = Msg}) ->
    remote(refreshed(RT), Node, To, Msg).

%% The runtime republished by a lane change or a stop, with this call's options
%% kept; undefined once convoy has stopped.
refreshed(#runtime{overload = O, block_timeout = T, refuse = R}) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined -> undefined;
        RT -> RT#runtime{overload = O, block_timeout = T, refuse = R}
    end.

%%--------------------------------------------------------------------
%% The paths of an admitted message (`convoy_path:decide/4')

perform(S = #send{node = Node, to = To, msg = Msg}, direct, {_Route, C, _Inboxes}, _Pieces) ->
    %% a plain peer: what the lane shipped is already in the connection
    convoy_sender:unmark(Node),
    case erlang:send(convoy_wire:address(To, Node), Msg, ?DIRECT_OPTS) of
        ok -> {0, count_direct(C)};
        _NoSuspendOrNoConnect -> to_lane(S)
    end;
perform(S, inbox, {_Route, C, Inboxes}, _Pieces) ->
    via_inbox(S, Inboxes, C);
perform(S = #send{rt = RT, lane = L, node = Node, to = To, msg = Msg}, inbox_barrier,
        {_Route, C, Inboxes}, _Pieces) ->
    %% The message goes to the inbox with a barrier behind it, and the sender
    %% waits (at most barrier_timeout ms) for the barrier's answer: then its
    %% marker goes and its next messages may go directly. The message itself
    %% never waits for the barrier. The admission is the lane's for the wait
    %% (`owed'): meanwhile the lane is not idle, so its other senders batch.
    convoy_sender:mark(Node),
    case convoy_wait:barrier(RT, L, Node, Inboxes, C, [{To, Msg}], owed) of
        ok ->
            convoy_sender:unmark(Node),
            {1, count_direct(C)};
        timeout ->
            {1, count_direct(C)};
        not_sent ->
            to_lane(S)
    end;
perform(_S, barrier_direct, {_Route, C, Inboxes}, _Pieces) ->
    %% the lane is idle: the barrier confirms the inbox, no admission held
    {0, {barrier, C, Inboxes}};
perform(_S, pieces, _Row, {Target, C}) ->
    {0, {pieces, Target, C}};
perform(_S, drain_pieces, _Row, {Target, C}) ->
    {0, {drain, Target, C}};
perform(S, lane, _Row, _Pieces) ->
    to_lane(S).

%% A multicast entry: through the inbox (fanned out there) or the lane.
entry_path(S = #send{rt = RT, lane = L, node = Node, to = Tos, size = Size}, V) ->
    Kind = size_kind(Size),
    Idle = idle(RT, L, V),
    Calm = case Kind of
               large -> busy;
               small -> convoy_sender:entry_calm(RT, L, Node)
           end,
    {Route, C, Inboxes} = case Idle of
                              true -> convoy_row:read_multi(Node, Tos);
                              false -> {none, undefined, none}
                          end,
    case convoy_path:multicast(Kind, Calm, Idle, Route) of
        inbox -> via_inbox(S, Inboxes, C);
        lane -> to_lane(S)
    end.

%% A batch of one to the inbox this sender's lane uses (an entry's `to' is its
%% list of destinations on the node).
via_inbox(S = #send{lane = L, node = Node, to = To, msg = Msg}, Inboxes, C) ->
    case to_inbox(L, Node, Inboxes, [wire_entry({To, Msg})]) of
        ok -> {0, count_direct(C)};
        _ -> to_lane(S)
    end.

%% Entries as one batch to the inbox lane L ships to on Node, never suspending,
%% the node marked (rule 3: they may wait in that inbox): ok, or not sent.
to_inbox(L, Node, Inboxes, Entries) ->
    convoy_sender:mark(Node),
    erlang:send({convoy_wire:lane_inbox(L, Inboxes), Node}, convoy_wire:batch(node(), Entries),
                ?DIRECT_OPTS).

wire_entry({{?TAG_PUBLISH, Scope, Group}, Msg}) -> convoy_wire:publish(Scope, Group, Msg);
wire_entry(Entry) -> Entry.

%%--------------------------------------------------------------------
%% To the lane, within the node's bound

%% Hand an admitted message to the lane, within the node's bounds (max_buffered
%% messages and max_buffered_bytes held by convoy for it, lane mailbox included).
%% When full, the overload policy decides. Large messages are tagged: the lane
%% never ships them in a batch with small ones (convoy_batch).
to_lane(S = #send{rt = RT, node = Node, size = Size}) ->
    {_Tag, Bytes} = kind(Size),
    {C, H} = convoy_row:refs(Node),
    case hold(RT, H, Bytes) of
        ok -> hand_over(S);
        full -> overloaded(S, C, H);
        closed -> reheld(S)
    end.

%% `to_lane/1' for a marked sender's small message once its room was asked for
%% (`convoy_held:hold_behind/4').
held(ok, #send{rt = #runtime{lanes = Lanes}, lane = L, node = Node, to = To, msg = Msg,
               size = {small, Bytes}}, _C, _H) ->
    erlang:send(element(L, Lanes), {?TAG_SEND, Node, To, Msg, Bytes}),
    {1, ok};
held(full, S, C, H) ->
    overloaded(S, C, H);
held(closed, S, _C, _H) ->
    reheld(S).

%% The row was forgotten (or is being checked by convoy_peers right now: let it
%% finish): the node's row is read again.
reheld(S = #send{node = Node}) ->
    convoy_sender:forget_refs(Node),
    erlang:yield(),
    to_lane(S).

kind({small, B}) -> {?TAG_SEND, B};
kind({multicast, B}) -> {?TAG_MULTICAST, B};
kind({large, B}) -> {?TAG_LARGE, B}.

hand_over(#send{rt = #runtime{lanes = Lanes}, lane = L, node = Node, to = To, msg = Msg,
                size = Size}) ->
    {Tag, Bytes} = kind(Size),
    convoy_sender:mark_lane(Node),
    erlang:send(element(L, Lanes), {Tag, Node, To, Msg, Bytes}),
    {1, ok}.

%% (a large message within its connection's buffer too: `convoy_path:held_bytes/4')
hold(RT, H, Bytes) ->
    convoy_held:hold(H, Bytes, RT).

%% No room: wait for it (the admission disposed of meanwhile, see `then/2'), or
%% refused now.
overloaded(#send{rt = RT = #runtime{overload = Policy}, size = Size}, C, H) ->
    case convoy_path:overload(Policy, Policy =:= block andalso
                                          convoy_metrics:may_wait_for_room(
                                            C, RT#runtime.barrier_timeout)) of
        wait ->
            {_Tag, Bytes} = kind(Size),
            {0, {room, C, H, Bytes}};
        refuse when Policy =:= drop ->
            {0, refused(RT#runtime{refuse = drop}, C)};
        refuse ->
            {0, refused(RT, C)}
    end.

%% Not sent: counted as dropped (send/2, or policy drop) or refused (send/3).
refused(#runtime{refuse = drop}, C) ->
    convoy_metrics:add(C, accepted, 1),
    convoy_metrics:add(C, dropped, 1),
    ok;
refused(#runtime{refuse = error}, C) ->
    convoy_metrics:add(C, refused, 1),
    {error, overload}.

%%--------------------------------------------------------------------
%% send_many/1's messages, together

%% A send_many's batch may bypass an idle lane unless batching is forced: it is a
%% batch already, so the lane's calm does not matter.
may_bypass_many(#runtime{bypass_after = never}) -> false;
may_bypass_many(_RT) -> true.

count(Nodes) ->
    lists:foldl(fun({_Node, _Entries, _Bytes, {_, Tos}}, Acc) -> Acc + length(Tos) end, 0,
                Nodes).

%% The nodes with room for all their messages go to the lane in one hand-over
%% (each such node marked); the others are left to send one by one.
hand_over_many(#runtime{lanes = Lanes} = RT, L, Nodes) ->
    {Sends, N, Left} = held_sends(RT, Nodes, [], 0, []),
    _ = N =:= 0 orelse erlang:send(element(L, Lanes), {?TAG_SENDS, Sends, N}),
    {N, {left, Left}}.

held_sends(_RT, [], Sends, N, Left) ->
    {Sends, N, lists:reverse(Left)};
held_sends(RT = #runtime{max_buffered = MaxN, max_buffered_bytes = MaxB},
           [{Node, Entries, Bytes, {_, Tos} = Group} | Rest], Sends, N, Left) ->
    K = length(Tos),
    {_C, H} = convoy_row:refs(Node),
    case convoy_held:hold_many(H, K, Bytes, MaxN, MaxB) of
        ok ->
            convoy_sender:mark_lane(Node),
            held_sends(RT, Rest, Entries ++ Sends, N + K, Left);
        _FullOrClosed ->
            held_sends(RT, Rest, Sends, N, [Group | Left])
    end.

%% A node's messages (`{To, Msg}', the wire's entries already) to the inbox this
%% sender's lane ships to: sent (counted direct), or not (too many for one batch,
%% a peer that is not an answering convoy node, a busy connection).
via_inbox_many(#runtime{max_batch = MaxBatch}, L, {Node, _Entries, _Bytes, {Node, Tos}}) ->
    K = length(Tos),
    case K =< MaxBatch andalso convoy_row:read(Node) of
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

%%--------------------------------------------------------------------
%% Multicast entries

%% @doc One multicast entry to `Node' (destinations there, or a `pg' group): one
%% copy travels, the inbox fans it out. It takes the path of the caller's other
%% messages to `Node', so it keeps its place among them.
-spec entry(#runtime{} | undefined, node(), [convoy:dest()] | {?TAG_PUBLISH, atom(), term()},
            term()) -> ok | {error, overload}.
entry(RT, Node, Tos, Msg) ->
    entry(RT, Node, Tos, Msg, entry_size(RT, Msg)).

%% @doc `Msg''s size as an entry's (`entry/5'): a multicast to several nodes
%% measures its message once.
-spec entry_size(#runtime{} | undefined, term()) -> entry_size().
entry_size(#runtime{stopping = false, large_threshold = T}, Msg) ->
    case convoy_size:measure(Msg, T) of
        {large, _} = Large -> Large;
        {small, B} -> {multicast, B}
    end;
entry_size(_RT, _Msg) ->
    none.

%% @doc `entry/4' with `Msg''s size already measured by `entry_size/2' under `RT'.
-spec entry(#runtime{} | undefined, node(), [convoy:dest()] | {?TAG_PUBLISH, atom(), term()},
            term(), entry_size()) -> ok | {error, overload}.
entry(undefined, Node, Tos, Msg, _Size) ->
    after_pieces(undefined, Node, wire_entry({Tos, Msg}),
                 fun() -> plain_send(Node, Tos, Msg) end);
entry(RT = #runtime{stopping = true}, Node, Tos, Msg, _Size) ->
    after_pieces(RT, Node, wire_entry({Tos, Msg}), fun() -> stopping(Node, Tos, Msg) end);
entry(RT, Node, Tos, Msg, Size) ->
    case convoy_lanes:runtime(RT, Node) of
        Row = #runtime{stopping = false} -> entry_row(Row, Node, Tos, Msg, Size);
        StoppingOrStopped -> entry(StoppingOrStopped, Node, Tos, Msg, Size)
    end.

entry_row(RT, Node, Tos, Msg, Size) ->
    L = convoy_lanes:lane_of(RT),
    S = #send{rt = RT, lane = L, node = Node, to = Tos, msg = Msg, size = Size, entry = true},
    case convoy_sender:marker(Node) of
        {pieces, Inbox} ->
            case convoy_row:lane_inbox(L, Node) of
                Inbox -> bracket(S, entry);
                _Other -> settle(RT, Node, Inbox, wire_entry({Tos, Msg}),
                                 fun() -> bracket(S, entry) end)
            end;
        _ ->
            bracket(S, entry)
    end.

%%--------------------------------------------------------------------
%% Messages in pieces

%% A large message in pieces through the lane's inbox (convoy_chunk_send), where
%% the sender's earlier messages to Node are all in the connection already (its
%% admission, if any, disposed of). The sender is marked while it waits;
%% `delivered' (like a barrier's answer) and `refused' (the inbox reached the
%% first piece, so it delivered everything before it) clear the marker.
chunked(S = #send{rt = RT, lane = L, node = Node, to = To, msg = Msg}, Target, C) ->
    convoy_sender:mark(Node),
    case convoy_chunk_send:send(RT, Node, Target, C, To, Msg) of
        delivered ->
            convoy_sender:unmark(Node),
            count_direct(C);
        sent ->
            %% A wait for the delivery ran out (counted `stalled'): the sender's
            %% next messages must not take another inbox before it (`settle/5').
            convoy_wait:ran_out(RT, L, Node, C, piece, timeout_native(RT)),
            convoy_sender:mark_pieces(Node, convoy_chunk_send:inbox_name(Target)),
            count_direct(C);
        refused ->
            convoy_sender:unmark(Node),
            direct_send(S);
        no_answer ->
            %% Its first piece may still be waiting: the lane ships it whole,
            %% behind that piece.
            convoy_wait:ran_out(RT, L, Node, C, piece, timeout_native(RT)),
            bracket(S, lane);
        dropped ->
            ok
    end.

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

%% After a message in pieces whose delivery was not confirmed: its pieces went
%% to the peer's inbox `Inbox' from this process, which may still be
%% reassembling it. Rule 1 keeps the sender's next messages behind it as long as
%% they go through the same inbox; when they would not (`lanes' changed, or
%% convoy stops or stopped), the sender first confirms `Inbox': a barrier from
%% this process is answered only once the pieces before it are delivered.
%% Without an answer, the message goes to `Inbox' itself, behind the pieces,
%% and the marker stays; a node marked unanswered is not waited for again.
after_pieces(RT, Node, Entry, Next) ->
    case convoy_sender:marker(Node) of
        {pieces, Inbox} -> settle(RT, Node, Inbox, Entry, Next);
        _ -> Next()
    end.

settle(RT, Node, Inbox, Entry, Next) ->
    {RT1, L} = convoy_lanes:prober(RT, Node),
    case convoy_wait:confirm(RT1, L, Node, Inbox, convoy_row:counters(Node)) of
        ok ->
            case RT of
                undefined -> convoy_sender:unmark(Node); % nothing of convoy's to wait for
                _ -> convoy_sender:confirmed(Node)
            end,
            Next();
        _TimeoutOrNotSent ->
            behind_pieces(RT, Node, Inbox, Entry, Next)
    end.

%% The message follows the pieces through their inbox: never suspending while
%% convoy runs (a full connection to a node that does not answer is overload:
%% refused at once and counted), as a plain send would once it stopped. Not
%% connected: the pieces went with the connection, nothing is left to follow.
behind_pieces(RT, Node, Inbox, Entry, Next) ->
    Opts = case RT of
               undefined -> [noconnect];
               _ -> ?DIRECT_OPTS
           end,
    case erlang:send({Inbox, Node}, convoy_wire:batch(node(), [Entry]), Opts) of
        ok when RT =:= undefined ->
            ok;
        ok ->
            convoy_row:count_direct(Node);
        nosuspend ->
            case convoy_row:counters(Node) of
                undefined -> ok;
                C -> refused(RT, C)
            end;
        noconnect ->
            convoy_sender:unmark(Node),
            Next()
    end.

%%--------------------------------------------------------------------
%% convoy not running, or stopping

plain_send(Node, {?TAG_PUBLISH, Scope, Group}, Msg) ->
    plain_send(Node, convoy_pg:members_on(Scope, Group, Node), Msg);
plain_send(Node, Tos, Msg) ->
    lists:foreach(fun(To) -> erlang:send(convoy_wire:address(To, Node), Msg) end, Tos),
    ok.

%% convoy is stopping: its lanes are closed and drain. A sender whose earlier
%% messages to Node went through its lane or an inbox waits until its lane is gone
%% (everything it held shipped and confirmed delivered by the peer's inbox, or
%% counted as dropped), so that its plain sends cannot overtake them.
stopping(Node, Tos, Msg) ->
    case convoy_sender:is_marked(Node) of
        false ->
            ok;
        true ->
            case convoy_runtimes:row(Node) of
                undefined -> ok; % no lane of its took anything for it
                Row -> convoy_wait:await_gone(convoy_lanes:lane(Row))
            end,
            convoy_sender:unmark(Node)
    end,
    plain_send(Node, Tos, Msg).

%%--------------------------------------------------------------------
%% Facts

slots(#runtime{slots = Slots}, L) -> element(L, Slots).

%% Whether lane `L' has disposed of every admission before admission `V'. With
%% max_delay set the user asked for batches: never bypass the lane then.
idle(RT = #runtime{max_delay = 0}, L, V) -> convoy_slots:idle(slots(RT, L), V);
idle(_RT, _L, _V) -> false.

size_kind({large, _}) -> large;
size_kind(_) -> small.

count_direct(C) ->
    convoy_metrics:add(C, direct, 1).
