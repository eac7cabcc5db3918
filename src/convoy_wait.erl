%% @private
%% Every wait a sender makes, in one place: for a barrier's answer (behind
%% entries of its own, or alone to confirm an inbox), for its lane to ship what
%% it holds for a node, for room in a node's bound, and for a stopping lane to be
%% gone. Each is bounded by a setting the caller chose or convoy's stop time;
%% each ends with nothing of it left in the caller's mailbox (`end_wait/2'); a
%% wait for a node's answer that runs out is counted and marks the node
%% (`waited/7'), so that its senders stop waiting on it until it answers again.
%%
%% Runs in the caller (a user's process). No wait here holds an admission that
%% only the caller could give back: see `convoy_send' and doc/design.md, "A
%% sender that dies".
-module(convoy_wait).

-export([barrier/7, confirm/5, flush/2, drain/4, room/7, end_wait/2, await_gone/1,
         unanswered/5, ran_out/6]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").

%% How long a sender waits for its lane when convoy stops (the stop itself is
%% bounded well below this; see convoy_control).
-define(STOP_WAIT_MS, 30000).
%% A sender waiting for room looks again this often without asking the lane.
-define(ROOM_LOOK_MS, 50).

-define(DIRECT_OPTS, [nosuspend, noconnect]).

%% @doc Send `Entries' with a barrier behind them to the inbox lane `L' ships to
%% on `Node' (never suspending), and wait at most barrier_timeout ms for the
%% barrier's answer, which comes once the inbox has delivered them and
%% everything this sender sent before: ok, timeout, or not_sent (the connection
%% was busy or down).
%%
%% The lane is monitored: if it goes, its inbox may not answer. The answer's tag
%% is the monitor's reference itself, so that every clause of the receive names
%% it: the compiler then has the receive skip what was in the mailbox before the
%% monitor was set up (a tag that only contained the reference made each wait
%% scan the caller's whole mailbox, which for a server answering a flood holds
%% thousands of requests). With `owed', the caller's admission is the lane's to
%% dispose of once sent: the lane is told before the wait and when it ends, and
%% disposes of it then, or when the caller dies meanwhile (`?TAG_OWED').
-spec barrier(#runtime{}, pos_integer(), node(), tuple(), counters:counters_ref(), list(),
              owed | none) -> ok | timeout | not_sent.
barrier(RT = #runtime{lanes = Lanes, barrier_timeout = Timeout}, L, Node, Inboxes, C,
        Entries, Admission) ->
    Lane = element(L, Lanes),
    Mon = erlang:monitor(process, Lane, [{alias, demonitor}]),
    Inbox = {convoy_wire:lane_inbox(L, Inboxes), Node},
    Batch = convoy_wire:batch(node(), Entries ++ [convoy_wire:barrier(Mon, Mon)]),
    Result = case erlang:send(Inbox, Batch, ?DIRECT_OPTS) of
                 ok ->
                     _ = Admission =:= owed andalso erlang:send(Lane, {?TAG_OWED, self()}),
                     T0 = erlang:monotonic_time(),
                     Answer = receive
                                  {Mon, convoy_barrier} -> ok;
                                  {'DOWN', Mon, process, _, _} -> lane_down
                              after Timeout ->
                                  timeout
                              end,
                     _ = Admission =:= owed andalso erlang:send(Lane, {?TAG_OWED_DONE, self()}),
                     waited(RT, L, C, Node, barrier, T0, Answer),
                     Answer;
                 _NoSuspendOrNoConnect ->
                     not_sent
             end,
    ok = end_wait(Mon, Result =:= timeout orelse Result =:= lane_down),
    case Result of
        lane_down -> timeout; % not the node's doing: it is not marked
        _ -> Result
    end.

%% @doc Confirm that the peer's inbox `Inbox' delivered everything this process
%% sent it (a barrier from this process, answered once what is before it is
%% delivered): ok, timeout or not_sent. `C' is the node's counters (undefined if
%% it has no row, or `RT' undefined when convoy is not running: then nothing is
%% counted), `L' the caller's lane (which probes the node if the wait runs
%% out). A node marked unanswered is not waited for again: one wait per stall.
-spec confirm(#runtime{} | undefined, pos_integer() | none, node(), atom(),
              counters:counters_ref() | undefined) -> ok | timeout | not_sent.
confirm(RT, L, Node, Inbox, C) ->
    case C =/= undefined andalso convoy_metrics:is_unanswered(C) of
        true -> timeout;
        false -> confirm_sent(RT, L, Node, Inbox, C)
    end.

confirm_sent(RT, L, Node, Inbox, C) ->
    Alias = alias([explicit_unalias]),
    Batch = convoy_wire:batch(node(), [convoy_wire:barrier(Alias, Alias)]),
    Result = case erlang:send({Inbox, Node}, Batch, ?DIRECT_OPTS) of
                 ok ->
                     T0 = erlang:monotonic_time(),
                     Answer = receive
                                  {Alias, convoy_barrier} -> ok
                              after barrier_timeout(RT) ->
                                  timeout
                              end,
                     _ = RT =:= undefined orelse C =:= undefined
                         orelse waited(RT, L, C, Node, barrier, T0, Answer),
                     Answer;
                 _NoSuspendOrNoConnect ->
                     not_sent
             end,
    true = unalias(Alias),
    receive {Alias, convoy_barrier} -> ok after 0 -> ok end,
    Result.

barrier_timeout(#runtime{barrier_timeout = T}) -> T;
barrier_timeout(undefined) -> maps:get(barrier_timeout, convoy_config:defaults()).

%% @doc Wait until each of `Lanes' (a node's lane, by node) has shipped (handed
%% to distribution) or counted as dropped everything it held for its node when
%% asked; all are asked at once. `down' if a lane went first (replaced or
%% stopped), `timeout' after `Timeout' ms.
-spec flush([{node(), pid()}], timeout()) -> ok | down | timeout.
flush(Lanes, Timeout) ->
    Mons = [begin
                Mon = erlang:monitor(process, Lane, [{alias, demonitor}]),
                Lane ! {?TAG_FLUSH, Node, Mon, Mon},
                Mon
            end || {Node, Lane} <- Lanes],
    flush_answers(Mons, case Timeout of
                            infinity -> infinity;
                            _ -> erlang:monotonic_time(millisecond) + Timeout
                        end).

flush_answers([], _Deadline) ->
    ok;
flush_answers([Mon | Rest], Deadline) ->
    Result = receive
                 {Mon, ok} -> ok;
                 {'DOWN', Mon, process, _, _} -> down
             after left_ms(Deadline) ->
                 timeout
             end,
    ok = end_wait(Mon, Result =/= ok),
    case Result of
        ok ->
            flush_answers(Rest, Deadline);
        _ ->
            lists:foreach(fun(M) -> ok = end_wait(M, true) end, Rest),
            Result
    end.

left_ms(infinity) -> infinity;
left_ms(Deadline) -> max(0, Deadline - erlang:monotonic_time(millisecond)).

%% @doc Wait (at most barrier_timeout ms) until lane `L' has shipped what it
%% holds for `Node', as `convoy:flush/1' does: ok or timeout, counted as a wait
%% for the node's answer.
-spec drain(#runtime{}, pos_integer(), node(), counters:counters_ref()) -> ok | timeout.
drain(RT = #runtime{lanes = Lanes, barrier_timeout = T}, L, Node, C) ->
    T0 = erlang:monotonic_time(),
    Drained = case flush([{Node, element(L, Lanes)}], T) of
                  ok -> ok;
                  _DownOrTimeout -> timeout
              end,
    waited(RT, L, C, Node, drain, T0, Drained),
    Drained.

%% @doc Wait at most `Timeout' ms for room for one message of `Bytes' in
%% `Node''s bound (`H', its held array): `ok' (the room is taken), `closed' (the
%% node's row was forgotten meanwhile), `timeout' (the node is marked, see
%% `convoy_metrics:unanswered/2': until it answers, the next sender over the
%% bound is refused at once), or `unanswered' (the node was marked as not
%% answering the lane's probe meanwhile, `convoy_metrics:may_wait_for_room/2':
%% waiting on is pointless); with the wait's deadline (native monotonic time),
%% which bounds what follows it. The time is counted in `blocked_us' and
%% reported by `[convoy, overload, blocked]'.
%% The sender registers with its lane once, and again only after a wake-up that
%% found no room (another sender took it); the lane wakes waiters oldest first as
%% it frees room. It also looks again every ROOM_LOOK_MS without asking the lane
%% (room freed by another lane, a wake-up spent on a sender gone, the node
%% marked meanwhile).
-spec room(#runtime{}, pos_integer(), node(), counters:counters_ref(), convoy_held:held(),
           non_neg_integer(), non_neg_integer()) ->
          {ok | closed | timeout | unanswered, Deadline :: integer()}.
room(RT, L, Node, C, H, Bytes, Timeout) ->
    T0 = erlang:monotonic_time(),
    Deadline = T0 + erlang:convert_time_unit(Timeout, millisecond, native),
    Result = room_until(RT, L, Node, C, H, Bytes, Deadline),
    Waited = erlang:monotonic_time() - T0,
    convoy_metrics:add(C, blocked_us, erlang:convert_time_unit(Waited, native, microsecond)),
    convoy_metrics:emit(RT#runtime.telemetry, [convoy, overload, blocked],
                        #{duration => Waited}, #{node => Node, result => Result}),
    _ = Result =:= timeout andalso unanswered(RT, L, Node, C, room),
    {Result, Deadline}.

room_until(RT = #runtime{lanes = Lanes}, L, Node, C, H, Bytes, Deadline) ->
    case hold(RT, H, Bytes) of
        full ->
            Lane = element(L, Lanes),
            Mon = erlang:monitor(process, Lane, [{alias, demonitor}]),
            Lane ! {?TAG_WAIT, Node, Mon, Bytes},
            Result = room_loop(RT, Lane, Mon, Node, C, H, Bytes, Deadline),
            %% a wake-up may be on its way whatever ended the wait
            ok = end_wait(Mon, true),
            Result;
        OkOrClosed ->
            OkOrClosed
    end.

room_loop(RT, Lane, Mon, Node, C, H, Bytes, Deadline) ->
    Left = (erlang:convert_time_unit(Deadline - erlang:monotonic_time(), native, microsecond)
            + 999) div 1000, % rounded up: never give up before block_timeout
    receive
        {Mon, room} ->
            case hold(RT, H, Bytes) of
                full ->
                    Lane ! {?TAG_WAIT, Node, Mon, Bytes},
                    room_loop(RT, Lane, Mon, Node, C, H, Bytes, Deadline);
                OkOrClosed ->
                    OkOrClosed
            end;
        {'DOWN', Mon, process, _, _} ->
            timeout
    after max(0, min(Left, ?ROOM_LOOK_MS)) ->
        case hold(RT, H, Bytes) of
            full when Left =< 0 ->
                timeout;
            full ->
                case convoy_metrics:may_wait_for_room(C, RT#runtime.barrier_timeout) of
                    true -> room_loop(RT, Lane, Mon, Node, C, H, Bytes, Deadline);
                    false -> unanswered
                end;
            OkOrClosed ->
                OkOrClosed
        end
    end.

hold(RT, H, Bytes) ->
    convoy_held:hold(H, Bytes, RT).

%% @doc End a wait for an answer tagged `Mon', a monitor of the lane with
%% `{alias, demonitor}': the demonitor deactivates the alias, so no answer comes
%% after it, and with `Unanswered' (the wait ended without taking its answer) one
%% that came just before is taken out of the caller's mailbox.
-spec end_wait(reference(), boolean()) -> ok.
end_wait(Mon, Unanswered) ->
    erlang:demonitor(Mon, [flush]),
    _ = Unanswered andalso receive {Mon, _} -> true after 0 -> false end,
    ok.

%% @doc Wait until a stopping lane is gone (bounded: a lane that outlives convoy's
%% shutdown time is killed by its supervisor).
-spec await_gone(pid()) -> ok.
await_gone(Lane) ->
    Mon = erlang:monitor(process, Lane),
    receive
        {'DOWN', Mon, process, _, _} -> ok
    after ?STOP_WAIT_MS ->
        erlang:demonitor(Mon, [flush]),
        ok
    end.

%% A caller waited for Node's answer since T0: the time is counted. A wait that
%% ran out marks the node unanswered, so its senders stop waiting on it until it
%% answers again (a stall costs each sender one wait, not one per message); it is
%% counted in `stalled' and reported by an event.
waited(RT, L, C, Node, Wait, T0, Result) ->
    Waited = erlang:monotonic_time() - T0,
    convoy_metrics:add(C, waited_us, erlang:convert_time_unit(Waited, native, microsecond)),
    case Result of
        timeout ->
            convoy_metrics:add(C, stalled, 1),
            ran_out(RT, L, Node, C, Wait, Waited);
        _ ->
            ok
    end.

%% @doc A wait of kind `Wait' for `Node''s answer ran out after `Waited' (native
%% time units; counted by the wait itself, here or in `convoy_chunk_send' for a
%% message in pieces): the node is marked unanswered, lane `L' probes it, and
%% the event is reported.
-spec ran_out(#runtime{}, pos_integer() | none, node(), counters:counters_ref(),
              barrier | drain | piece, integer()) -> ok.
ran_out(RT, L, Node, C, Wait, Waited) ->
    ok = unanswered(RT, L, Node, C, wait),
    convoy_metrics:emit(RT#runtime.telemetry, [convoy, node, unanswered],
                        #{duration => Waited}, #{node => Node, wait => Wait}).

%% @doc Mark `Node' unanswered (`convoy_metrics:unanswered/2') and ask lane `L' to
%% probe it, so the mark clears once the node answers even if no lane ships to
%% it meanwhile (a lane probing it already ignores the request).
-spec unanswered(#runtime{}, pos_integer() | none, node(), counters:counters_ref(),
                 wait | room) -> ok.
unanswered(_RT, none, _Node, C, Why) ->
    convoy_metrics:unanswered(C, Why);
unanswered(#runtime{lanes = Lanes}, L, Node, C, Why) ->
    ok = convoy_metrics:unanswered(C, Why),
    element(L, Lanes) ! {?TAG_PROBE, Node},
    ok.
