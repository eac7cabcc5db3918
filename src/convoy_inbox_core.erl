%% @private
%% The decisions of an inbox, pure: `handle(Input, Core) -> {Core, Actions}'. The
%% inbox process (`convoy_inbox') reads its mailbox, gathers the facts an input
%% needs, hands the input here and carries out the actions in order. This module
%% never sends, monitors, reads a table or the clock, so every rule below is
%% tested without processes (`test/prop_convoy_inbox_core_tests.erl').
%%
%% What it holds: the unfinished batches per node and the order in which nodes
%% take turns; the partial messages in pieces (`convoy_chunk:rx()'), the bytes
%% this inbox reserves for them per node in the bound it shares with the other
%% inboxes, and the tick's timer; and, while it waits for an answer, where the
%% slice goes on.
%%
%% Requests. Some facts are known only part way through a batch: a publish
%% entry's members, a monitor of a piece's sender, the room the node's other
%% inboxes leave for its partial messages, whether a reservation held, a timer.
%% An action list may then end with a request (`request()'); its answer is the
%% very next input, and the core goes on from where it stopped. Nothing else is
%% handed in meanwhile, so a request sees everything before it carried out.
%% Joining a completed message in pieces is a request too (`assemble'), though
%% `convoy_chunk:assemble/2' is pure: it copies the whole message (milliseconds
%% for megabytes), and the actions before it, among them the acknowledgement
%% that gives the node's next message in pieces its turn, must not wait for
%% that copy. A run of plain sends is a request too (`deliver_plain'): the shell
%% sends them in the walk that checks them, as `convoy_plain:run/5' with
%% `send', and answers how many it sent and where the run ended; the core never
%% sends, and the rule of what is plain is `convoy_plain''s.
%%
%% Slices. One entry costs at most `convoy_wire:max_entry_words/0' word copies; a
%% batch is delivered in slices of at most that budget (each entry costing
%% `convoy_wire:cost/1', a slice holds at least one entry). An unfinished batch
%% waits for a `slice' input; a node's later batches wait behind its unfinished
%% one, so its entries are delivered in the order they came, and unfinished
%% batches of different nodes take turns. A publish entry's members, and a run's
%% destinations, are sent to in slices as well (`convoy_wire:take_members/3').
%%
%% Runs. Publish entries to the same group, or multicast entries to the same
%% destinations, one after the other, are delivered destination by destination:
%% each gets the run's messages back to back, in order, so it is woken once for
%% all of them, and a pid's incarnation is checked once per run. Only when the
%% destinations are provably distinct processes, distinct pids (else a process
%% listed twice, or as a pid and by a name or an alias, would get a second copy
%% of the first message after the second message): otherwise each entry goes to
%% all its destinations before the next, as a loop of `!' sends. A run lasts
%% while one destination's sends of all its messages stay within the budget.
%%
%% Incarnations. This node's name and `creation' (`here()') come with each batch
%% and slice, as they are then: the node may be named after the inbox started,
%% or renamed, and a pid or alias of this node stored in a batch (decoded on
%% arrival) is of the node as it is named now. A pid or alias of an old
%% incarnation of this node (same name, another `creation') is counted
%% `undeliverable' and not sent to, as `!' drops it on the sending node. Each is
%% checked (`convoy_wire:incarnation/2') unless it is the last one found current
%% in the same slice.
%%
%% Messages in pieces (`convoy_chunk' holds their state). The completed message
%% is delivered at the position of its last piece. A start is decided against the
%% room the node's other inboxes leave this one, then reserved in the shared
%% bound (`convoy_chunk_bound'), and refused after all if another inbox took that
%% room meanwhile; a start over the bound is answered `refused' (the sender then
%% sends the message whole). The sender is watched while its message is held (a
%% watch, `convoy_remote:watch/2', is the shell's: the core keeps it with the
%% partial and asks for it to be dropped): its `DOWN' (only of that watch) and
%% its node's `nodedown' discard the partial. A node's messages take turns (see `convoy_chunk'); while partials are
%% held a tick comes every `?TICK_MS' ms, and a start waits for its turn at most
%% half of `barrier_timeout', so its sender, which gives up after it, gets the
%% turn first. At a tick, partials of senders that no longer monitor the inbox
%% are swept (`convoy_chunk:sweep/3'), with the nodes of unfinished batches busy;
%% the next tick's timer is asked for after the sweep, so its message comes after
%% everything the inbox had received at the sweep.
-module(convoy_inbox_core).

-export([new/0, handle/2, busy/1, turn/1, summary/1]).

-export_type([core/0, input/0, action/0, request/0, answer/0, job/0, here/0]).

-define(TICK_MS, 10).

%% The rest of a batch: its tag (the shell's counters of the node), the first
%% entry perhaps already checked (or a run part way), the entries after it.
-type job() :: {Tag :: term(), checked() | none, maybe_improper_list()}.
%% An entry checked, or what is left of a run: the destinations still to send
%% to, the run's messages and what sending them to one destination costs.
-type checked() :: convoy_wire:checked() | {members | dests, list(), [term()], pos_integer()}.
-type bound() :: pos_integer() | infinity.

-record(core, {%% unfinished batches per node, oldest first; nodes take turns
               work = #{} :: #{node() => queue:queue(job())},
               turns = queue:new() :: queue:queue(node()),
               rx = convoy_chunk:new() :: convoy_chunk:rx(),
               %% bytes this inbox reserves per node in the shared bound
               reserved = #{} :: #{node() => pos_integer()},
               %% the tick's timer, while one is coming
               timer = none :: none | reference(),
               %% waiting for the answer to a request: where to go on
               paused = none :: none | timer | {cont(), walk()}}).

%% A slice under way: the node and tag of its job, whether the job was new (the
%% node had no unfinished batch) or took its turn, and the facts it needs.
-record(d, {from :: node(),
            tag :: term(),
            origin :: new | turn,
            local :: node(),
            creation :: non_neg_integer(),
            budget :: pos_integer(),
            core :: #core{} | undefined}).

-opaque core() :: #core{}.
-type walk() :: #d{}.
%% Where a slice goes on: the entries left, the budget left, the messages
%% delivered so far (counted `received') and the last pid or alias found current.
-type pos() :: {maybe_improper_list(), integer(), non_neg_integer(), term()}.
-type cont() :: {plain, pos()}
              | {members, atom(), term(), term(), pos()}
              | {assembled, convoy_wire:dest(), reference(), pos()}
              | {start, convoy_chunk:start(), pos()}
              | {room, convoy_chunk:start(), pos()}
              | {reserve, convoy_chunk:start(), tuple(), pos_integer(), pos()}.

%% This node's name and `creation' when the input is handed in.
-type here() :: {node(), Creation :: non_neg_integer()}.
-type input() :: {batch, node(), Tag :: term(), maybe_improper_list(), here()}
               | {slice, here()}
               | {down, convoy_remote:watch(), pid()}
               | {nodedown, node()}
               | {tick, TRef :: reference(), Watching :: [term()], BarrierTimeout :: non_neg_integer()}
               | answer().
-type request() :: {deliver_plain, list(), pos_integer(), Good :: term(), Local :: node()}
                 | {members, Scope :: atom(), Group :: term()}
                 | {monitor, pid()}
                 | {room, node()}
                 | {reserve, node(), Old :: non_neg_integer(), Held :: pos_integer(), bound()}
                 | {start_timer, Ms :: pos_integer()}
                 | {assemble, convoy_chunk:kind(), [binary()]}.
-type answer() :: {delivered_plain, non_neg_integer(), list(), Good :: term()}
                | {members, {ok, list()} | no_scope}
                | {assembled, {ok, term()} | error}
                | {monitored, convoy_remote:watch()}
                | {room, non_neg_integer() | infinity, bound()}
                | {reserved, boolean()}
                | {timer, reference()}.
%% `deliver': a local send (to a name nobody holds it is dropped and counted
%% `undeliverable' by the shell); `deliver_each': the
%% message to each destination in turn; `deliver_all': the messages to one
%% destination back to back; `publish': to each of this node's pids among the
%% members, the messages back to back; `piece_reply': `{Ref, convoy_piece, What}' to a
%% piece's sender; `release': this inbox now reserves `Held' bytes for the node.
-type action() :: {deliver, convoy_wire:dest(), term()}
                | {deliver_each, [convoy_wire:dest()], term()}
                | {deliver_all, convoy_wire:dest(), [term()]}
                | {publish, list(), [term()]}
                | {barrier, pid() | reference(), term()}
                | {meter, pid() | reference(), term()}
                | {piece_reply, reference(), non_neg_integer() | refused | delivered}
                | {demonitor, convoy_remote:watch()}
                | {release, node(), non_neg_integer()}
                | {forget, node()}
                | {received, Tag :: term(), pos_integer()}
                | {rejected, convoy_metrics:rejection()}
                | request().

%% @doc A core holding nothing.
-spec new() -> core().
new() -> #core{}.

%% @doc Take one input. Actions are to be carried out in order; a request is
%% always the last one, and its answer is the next input.
-spec handle(input(), core()) -> {core(), [action()]}.
handle({batch, From, Tag, Entries, Here}, C = #core{paused = none, work = Work}) ->
    case Work of
        #{From := Q} -> {C#core{work = Work#{From := queue:in({Tag, none, Entries}, Q)}}, []};
        _ -> slice(new, From, {Tag, none, Entries}, Here, C)
    end;
handle({slice, Here}, C = #core{paused = none, work = Work, turns = Turns}) ->
    case queue:out(Turns) of
        {empty, _} ->
            {C, []};
        {{value, Node}, Turns1} ->
            {{value, Job}, Q} = queue:out(maps:get(Node, Work)),
            slice(turn, Node, Job, Here, C#core{work = Work#{Node := Q}, turns = Turns1})
    end;
handle({down, Mon, Pid}, C = #core{paused = none}) ->
    %% Only the monitor kept with the sender's partial counts.
    {Mons, Rx} = convoy_chunk:down(Pid, Mon, C#core.rx),
    {C1, A} = store(Rx, C, []),
    settle(C1, case Mons of
                   [] -> [{rejected, unknown_message} | A];
                   _ -> discarded(Mons, A)
               end);
handle({nodedown, Node}, C = #core{paused = none}) ->
    {Mons, Rx} = convoy_chunk:nodedown(Node, C#core.rx),
    {C1, A} = store(Rx, C, []),
    settle(C1, [{forget, Node} | discarded(Mons, A)]);
handle({tick, TRef, Watching, BarrierTimeout}, C = #core{paused = none, timer = TRef}) ->
    {Mons, Rx} = convoy_chunk:sweep(Watching, maps:keys(C#core.work), C#core.rx),
    A = discarded(Mons, []),
    Patience = max(1, BarrierTimeout div (2 * ?TICK_MS)),
    {C1, A1} = store(convoy_chunk:tick(Patience, Rx), C#core{timer = none}, A),
    settle(C1, A1);
handle({tick, _TRef, _Watching, _BarrierTimeout}, C = #core{paused = none}) ->
    {C, [{rejected, unknown_message}]}; % not the tick's timer
handle({timer, TRef}, C = #core{paused = timer}) ->
    {C#core{timer = TRef, paused = none}, []};
handle(Answer, C = #core{paused = {Cont, D}}) ->
    finish(resume(Answer, Cont, D#d{core = C#core{paused = none}})).

%% @doc Whether a batch is unfinished (then a `slice' input should come after
%% each message the inbox handles, or at once with none).
-spec busy(core()) -> boolean().
busy(#core{turns = Turns}) -> not queue:is_empty(Turns).

%% @doc The node whose unfinished batch the next `slice' goes on with, if any.
-spec turn(core()) -> node() | none.
turn(#core{turns = Turns}) ->
    case queue:peek(Turns) of
        {value, Node} -> Node;
        empty -> none
    end.

%% @doc For `sys:get_state/1': unfinished batches per node, partial messages held
%% and their bytes per node.
-spec summary(core()) -> #{unfinished := #{node() => [job()]}, partials := non_neg_integer(),
                           held := #{node() => pos_integer()}}.
summary(#core{work = Work, rx = Rx}) ->
    #{unfinished => maps:map(fun(_, Q) -> queue:to_list(Q) end, Work),
      partials => convoy_chunk:partials(Rx),
      held => convoy_chunk:held(Rx)}.

%%--------------------------------------------------------------------
%% Slices

slice(Origin, Node, {Tag, First, Entries}, {Local, Creation}, C) ->
    Budget = convoy_wire:max_entry_words(),
    D = #d{from = Node, tag = Tag, origin = Origin, local = Local, creation = Creation,
           budget = Budget, core = C},
    finish(case First of
               none -> deliver(Entries, Budget, 0, undefined, [], D);
               _ -> step(First, Entries, Budget, 0, undefined, [], D)
           end).

%% A slice ended (its job done, or the rest of it left for a later slice), or
%% stopped for a request.
finish({pause, Request, Cont, A, D = #d{core = C}}) ->
    {C#core{paused = {Cont, D#d{core = undefined}}}, lists:reverse(A, [Request])};
finish({done, N, A, D}) ->
    ended(done, N, A, D);
finish({stop, Checked, Rest, N, A, D}) ->
    ended({D#d.tag, Checked, Rest}, N, A, D).

ended(Left, N, A, #d{from = Node, tag = Tag, origin = Origin, core = C}) ->
    A1 = case N of
             0 -> A;
             _ -> [{received, Tag, N} | A]
         end,
    settle(requeue(Origin, Node, Left, C), A1).

requeue(new, _Node, done, C) ->
    C;
requeue(new, Node, Job, C = #core{work = Work}) ->
    C#core{work = Work#{Node => queue:from_list([Job])}, turns = queue:in(Node, C#core.turns)};
requeue(turn, Node, Left, C = #core{work = Work}) ->
    Q = case Left of
            done -> maps:get(Node, Work);
            Job -> queue:in_r(Job, maps:get(Node, Work))
        end,
    case queue:is_empty(Q) of
        true -> C#core{work = maps:remove(Node, Work)};
        false -> C#core{work = Work#{Node := Q}, turns = queue:in(Node, C#core.turns)}
    end.

%% The end of an input: while partial messages are held, a tick must be coming.
settle(C = #core{timer = none, rx = Rx}, A) ->
    case convoy_chunk:partials(Rx) > 0 of
        true -> {C#core{paused = timer}, lists:reverse(A, [{start_timer, ?TICK_MS}])};
        false -> {C, lists:reverse(A)}
    end;
settle(C, A) ->
    {C, lists:reverse(A)}.

%% Deliver entries while the slice has budget Left; N counts messages delivered
%% (one per send, multicast or publish entry); Good is the last pid or alias
%% found current; A holds the actions, newest first. Stops at an improper tail.
deliver([], _Left, N, _Good, A, D) ->
    {done, N, A, D};
deliver([{To, _} | _] = Entries, Left, N, Good, A, D) when is_pid(To); is_atom(To) ->
    %% Plain sends in a row (most of a flood's batch) are sent by the shell in the
    %% walk that checks them (`convoy_plain:run/5'), which answers how many:
    %% nothing is rebuilt for each of them, and each is walked once.
    Local = D#d.local,
    case Left div convoy_wire:send_cost() of
        Max when Max > 0 ->
            case convoy_plain:run(Entries, 1, Good, Local, count) of
                {1, _, _, _} ->
                    {pause, {deliver_plain, Entries, Max, Good, Local},
                     {plain, {Entries, Left, N, Good}}, A, D};
                _NotPlain ->
                    deliver_one(Entries, Left, N, Good, A, D)
            end;
        0 ->
            deliver_one(Entries, Left, N, Good, A, D)
    end;
deliver(Entries, Left, N, Good, A, D) ->
    deliver_one(Entries, Left, N, Good, A, D).

deliver_one([E | Rest], Left, N, Good, A, D) ->
    step(convoy_wire:entry(E, D#d.from, D#d.local), Rest, Left, N, Good, A, D);
deliver_one(_ImproperTail, _Left, N, _Good, A, D) ->
    {done, N, [{rejected, malformed_batch} | A], D}.

step({Kind, Tos, Msgs, Each}, Rest, Left, N, Good, A, D) when Kind =:= members;
                                                              Kind =:= dests ->
    %% A run's sends (one publish entry is a run of one), to as many destinations
    %% as this slice has room for (at least one in a whole slice); the rest wait
    %% for the next slices, ahead of Rest.
    case convoy_wire:take_members(Tos, Each, Left) of
        {Now, []} ->
            {Good1, A1} = send_run(Kind, Now, Msgs, Good, A, D),
            deliver(Rest, Left - length(Now) * Each, N, Good1, A1, D);
        {Now, Later} ->
            {_, A1} = send_run(Kind, Now, Msgs, Good, A, D),
            {stop, {Kind, Later, Msgs, Each}, Rest, N, A1, D}
    end;
step(Checked, Rest, Left, N, Good, A, D) ->
    Cost = convoy_wire:cost(Checked),
    case Cost > Left andalso Left < D#d.budget of
        true -> {stop, Checked, Rest, N, A, D};
        false -> entry(Checked, Cost, Rest, Left, N, Good, A, D)
    end.

entry({deliver, To, _Msg} = Send, Cost, Rest, Left, N, Good, A, D) when is_atom(To);
                                                                       To =:= Good ->
    deliver(Rest, Left - Cost, N + 1, Good, [Send | A], D);
entry({deliver, To, _Msg} = Send, Cost, Rest, Left, N, Good, A, D) ->
    case verdict(To, Good, D) of
        send -> deliver(Rest, Left - Cost, N + 1, Good, [Send | A], D);
        current -> deliver(Rest, Left - Cost, N + 1, To, [Send | A], D);
        old -> deliver(Rest, Left - Cost, N + 1, Good, [{rejected, undeliverable} | A], D)
    end;
entry({multicast, Tos, Msg, _}, Cost, Rest, Left, N, Good, A, D) ->
    case multicast_run(Tos, Msg, Cost, Rest, D) of
        none ->
            {Good1, A1} = multicast(Tos, Msg, Good, A, D),
            deliver(Rest, Left - Cost, N + 1, Good1, A1, D);
        {Msgs, Each, K, Rest1} ->
            step({dests, Tos, Msgs, Each}, Rest1, Left, N + K, Good, A, D)
    end;
entry({publish, Scope, Group, Msg}, Cost, Rest, Left, N, Good, A, D) ->
    %% Its members as pg has them when the slice reaches it.
    {pause, {members, Scope, Group}, {members, Scope, Group, Msg, {Rest, Left - Cost, N, Good}},
     A, D};
entry({Barrier, ReplyTo, Tag}, Cost, Rest, Left, N, Good, A, D)
  when Barrier =:= barrier; Barrier =:= meter ->
    deliver(Rest, Left - Cost, N, Good, [{Barrier, ReplyTo, Tag} | A], D);
entry({piece_start, St = #{sender := Sender}}, Cost, Rest, Left, N, Good, A, D) ->
    {pause, {monitor, Sender}, {start, St, {Rest, Left - Cost, N, Good}}, A, D};
entry({piece, Ref, Seq, Data}, Cost, Rest, Left, N, Good, A, D = #d{core = C}) ->
    {R, Rx} = convoy_chunk:piece(D#d.from, Ref, Seq, Data, C#core.rx),
    {C1, A1} = store(Rx, C, A),
    result(R, Ref, {Rest, Left - Cost, N, Good}, A1, D#d{core = C1});
entry({error, Kind}, Cost, Rest, Left, N, Good, A, D) ->
    deliver(Rest, Left - Cost, N, Good, [{rejected, Kind} | A], D).

go_on({Rest, Left, N, Good}, A, D) ->
    deliver(Rest, Left, N, Good, A, D).

%% Whether a send to a pid or alias goes out: `current' (this incarnation's:
%% remembered as Good), `send' (its incarnation unknown) or `old'.
verdict(To, Good, _D) when is_atom(To); To =:= Good ->
    send;
verdict(To, _Good, #d{creation = Creation}) ->
    case convoy_wire:incarnation(To, Creation) of
        current -> current;
        unknown -> send;
        old -> old
    end.

%% A multicast entry's sends: one action for its whole list when each of its
%% destinations may be sent to (the usual case, where an action per destination
%% only made garbage), else one per destination, an old incarnation's counted.
multicast([_] = To, Msg, Good, A, D) ->
    multicast_each(To, Msg, Good, A, D);
multicast(Tos, Msg, Good, A, D) ->
    case sendable(Tos, Good, D) of
        {ok, Good1} -> {Good1, [{deliver_each, Tos, Msg} | A]};
        old -> multicast_each(Tos, Msg, Good, A, D)
    end.

sendable([], Good, _D) ->
    {ok, Good};
sendable([To | Tos], Good, D) ->
    case verdict(To, Good, D) of
        send -> sendable(Tos, Good, D);
        current -> sendable(Tos, To, D);
        old -> old
    end.

multicast_each([], _Msg, Good, A, _D) ->
    {Good, A};
multicast_each([To | Tos], Msg, Good, A, D) ->
    case verdict(To, Good, D) of
        send -> multicast_each(Tos, Msg, Good, [{deliver, To, Msg} | A], D);
        current -> multicast_each(Tos, Msg, To, [{deliver, To, Msg} | A], D);
        old -> multicast_each(Tos, Msg, Good, [{rejected, undeliverable} | A], D)
    end.

%% A run's messages to each destination, back to back; a destination of an old
%% incarnation counts each message it does not get.
send_run(members, Members, Msgs, Good, A, _D) ->
    {Good, [{publish, Members, Msgs} | A]};
send_run(dests, [], _Msgs, Good, A, _D) ->
    {Good, A};
send_run(dests, [To | Tos], Msgs, Good, A, D) ->
    case verdict(To, Good, D) of
        send -> send_run(dests, Tos, Msgs, Good, [{deliver_all, To, Msgs} | A], D);
        current -> send_run(dests, Tos, Msgs, To, [{deliver_all, To, Msgs} | A], D);
        old -> send_run(dests, Tos, Msgs, Good, [{rejected, undeliverable} || _ <- Msgs] ++ A, D)
    end.

%%--------------------------------------------------------------------
%% Runs: entries right after one that send to the same destinations. Every entry
%% is checked as any other: the first that does not continue the run ends it and
%% is handled in turn.

%% A publish entry's run: its messages, Each, how many entries, what follows.
publish_run(Members, Scope, Group, Msg, Rest, D = #d{from = From, local = Local}) ->
    Each = convoy_wire:send_words(Msg),
    Next = fun(E) ->
                   case convoy_wire:entry(E, From, Local) of
                       {publish, Scope, Group, M} -> {ok, M, convoy_wire:send_words(M)};
                       _ -> stop
                   end
           end,
    case Rest of
        [E | _] ->
            case Next(E) =/= stop andalso distinct_pids(Members) of
                true -> run(Rest, Next, [Msg], Each, 1, D#d.budget);
                false -> {[Msg], Each, 1, Rest}
            end;
        _ ->
            {[Msg], Each, 1, Rest}
    end.

%% A multicast entry's run (two or more destinations), or none.
multicast_run(Tos, Msg, Cost, Rest, D) ->
    N = length(Tos),
    Next = fun(E) ->
                   case convoy_wire:entry_to(E, Tos, N) of
                       {multicast, _, M, C} -> {ok, M, C div N};
                       _ -> stop
                   end
           end,
    case Rest of
        [E | _] when N >= 2 ->
            case Next(E) =/= stop andalso distinct_pids(Tos) of
                true -> run(Rest, Next, [Msg], Cost div N, 1, D#d.budget);
                false -> none
            end;
        _ ->
            none
    end.

run([E | Rest] = Entries, Next, Acc, Each, K, Budget) ->
    case Next(E) of
        {ok, Msg, W} when Each + W =< Budget -> run(Rest, Next, [Msg | Acc], Each + W, K + 1, Budget);
        _ -> {lists:reverse(Acc), Each, K, Entries}
    end;
run(Entries, _Next, Acc, Each, K, _Budget) ->
    {lists:reverse(Acc), Each, K, Entries}.

%% Whether a run's destinations are provably distinct processes: pids, none
%% listed twice. Distinct terms are not enough: a name or an alias can
%% be the same process as a pid of the list, and a name can change hands during
%% the run; a pid that joined a pg group twice is a member twice. Distinct pids
%% of this node are distinct processes (one of an old incarnation is never sent
%% to). A scope's row that is not pg's may hold anything, an improper list too.
distinct_pids(L) ->
    case count_pids(L, 0) of
        {ok, Len} -> length(lists:usort(L)) =:= Len;
        other -> false
    end.

count_pids([P | Rest], N) when is_pid(P) -> count_pids(Rest, N + 1);
count_pids([], N) -> {ok, N};
count_pids(_, _N) -> other.

%%--------------------------------------------------------------------
%% Answers to requests

resume({delivered_plain, 0, _Rest, _Good}, {plain, {Entries, Left, N, Good}}, D) ->
    %% the run's first entry was plain when asked: only a shell that answers
    %% otherwise gets here, and it must not ask again
    deliver_one(Entries, Left, N, Good, [], D);
resume({delivered_plain, K, Rest, Good1}, {plain, {_Entries, Left, N, _Good}}, D) ->
    deliver(Rest, Left - K * convoy_wire:send_cost(), N + K, Good1, [], D);
resume({members, {ok, Members}}, {members, Scope, Group, Msg, {Rest, Left, N, Good}}, D) ->
    {Msgs, Each, K, Rest1} = publish_run(Members, Scope, Group, Msg, Rest, D),
    step({members, Members, Msgs, Each}, Rest1, Left, N + K, Good, [], D);
resume({members, no_scope}, {members, _Scope, _Group, _Msg, Pos}, D) ->
    go_on(Pos, [{rejected, undeliverable}], D);
resume({assembled, Joined}, {assembled, To, Ref, {Rest, Left, N, Good}}, D) ->
    Done = {piece_reply, Ref, delivered},
    case Joined of
        {ok, Msg} ->
            %% The message passes the checks a batch entry passes (a message that
            %% is itself a batch would make the inbox feed itself).
            case convoy_wire:entry({To, Msg}, D#d.from, D#d.local) of
                {deliver, _, _} ->
                    {Good1, A} = multicast([To], Msg, Good, [], D),
                    deliver(Rest, Left, N + 1, Good1, [Done | A], D);
                {error, Kind} ->
                    deliver(Rest, Left, N, Good, [Done, {rejected, Kind}], D)
            end;
        error ->
            deliver(Rest, Left, N, Good, [Done, {rejected, bad_piece}], D)
    end;
resume({monitored, Mon}, {start, St, Pos}, D) ->
    {pause, {room, D#d.from}, {room, St#{mon => Mon}, Pos}, [], D};
resume({room, Room, Bound}, {room, St, Pos}, D = #d{from = Node, core = C}) ->
    %% Decided against the room the node's other inboxes leave; a start that
    %% needs more than this inbox reserves must be reserved first.
    Rx0 = C#core.rx,
    Held0 = convoy_chunk:held(Node, Rx0),
    {_, _, Rx} = Result = convoy_chunk:start(Node, St, Room, Rx0),
    case convoy_chunk:held(Node, Rx) of
        Held when Held > Held0 ->
            Old = maps:get(Node, C#core.reserved, 0),
            {pause, {reserve, Node, Old, Held, Bound}, {reserve, St, Result, Held, Pos}, [], D};
        _ ->
            started(Result, St, Pos, D)
    end;
resume({reserved, true}, {reserve, St, Result, Held, Pos}, D = #d{from = Node, core = C}) ->
    C1 = C#core{reserved = (C#core.reserved)#{Node => Held}},
    started(Result, St, Pos, D#d{core = C1});
resume({reserved, false}, {reserve, St, _Result, _Held, Pos}, D = #d{from = Node, core = C}) ->
    %% Another inbox took the room meanwhile.
    started(convoy_chunk:start(Node, St, 0, C#core.rx), St, Pos, D).

%%--------------------------------------------------------------------
%% Messages in pieces

started({R, Dropped, Rx}, #{ref := Ref, mon := Mon}, Pos, D = #d{core = C}) ->
    {C1, A} = store(Rx, C, []),
    A1 = discarded(Dropped, A),
    A2 = case R of
             {ack, _} -> A1;
             stored -> A1;                 % waits for its turn
             {complete, _, _, _, _} -> A1; % its monitor goes with the result
             _ -> [{demonitor, Mon} | A1]
         end,
    result(R, Ref, Pos, A2, D#d{core = C1}).

%% The state after a change: the room of partials gone is given back, and the
%% starts whose turn came are acknowledged.
store(Rx0, C = #core{reserved = Reserved}, A) ->
    {Granted, Rx} = convoy_chunk:take_granted(Rx0),
    {Reserved1, A1} = maps:fold(fun(Node, Bytes, {R, Acc}) ->
                                        case convoy_chunk:held(Node, Rx) of
                                            Bytes -> {R, Acc};
                                            0 -> {maps:remove(Node, R), [{release, Node, 0} | Acc]};
                                            H -> {R#{Node := H}, [{release, Node, H} | Acc]}
                                        end
                                end, {Reserved, A}, Reserved),
    A2 = lists:foldl(fun(Ref, Acc) -> [{piece_reply, Ref, 0} | Acc] end, A1, Granted),
    {C#core{rx = Rx, reserved = Reserved1}, A2}.

discarded(Mons, A) ->
    lists:foldl(fun(M, Acc) -> [{rejected, partial_discarded}, {demonitor, M} | Acc] end, A, Mons).

result({ack, Seq}, Ref, Pos, A, D) ->
    go_on(Pos, [{piece_reply, Ref, Seq} | A], D);
result(stored, _Ref, Pos, A, D) ->
    go_on(Pos, A, D);
result({complete, Kind, To, Parts, Mon}, Ref, Pos, A, D) ->
    {pause, {assemble, Kind, Parts}, {assembled, To, Ref, Pos}, [{demonitor, Mon} | A], D};
result(refused, Ref, Pos, A, D) ->
    go_on(Pos, [{piece_reply, Ref, refused}, {rejected, reassembly_full} | A], D);
result({error, bad_piece}, _Ref, Pos, A, D) ->
    go_on(Pos, [{rejected, bad_piece} | A], D).
