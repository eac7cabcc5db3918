%% @private
%% An inbound lane: registered as `convoy_inbox_I', it takes batches from peers'
%% lanes (see `convoy_wire') and delivers their entries, in order, with local sends.
%%
%% A connected node is trusted, but what reaches an inbox may be stray, duplicated,
%% misdirected or malformed: batches of unknown versions, from nodes that are not
%% connected, malformed entries, barriers for a third node, multicasts over the
%% limits, destinations of an old incarnation of this node and stray terms are
%% counted (see `convoy:info/0', `rejected') and the first of each kind is logged
%% (`undeliverable' is only counted); the valid entries of a batch are still
%% delivered.
%%
%% Bounded work before other traffic gets its turn. One entry costs at most
%% `convoy_wire:max_entry_words/0' word copies (about 5-15 ms; `convoy_wire'
%% rejects costlier multicasts). A batch has no limit on its number of entries, so
%% the inbox delivers a batch in slices of at most that same budget (each entry
%% costing `convoy_wire:cost/1'; a slice holds at least one entry) and, while some
%% batch is unfinished, handles one message from its mailbox between slices. A
%% node's later batches wait behind its unfinished one, so entries from one node
%% are still delivered in the order they came; unfinished batches of different
%% nodes take turns. A batch of up to 8192 plain sends fits in one slice, so
%% ordinary batches (`max_batch' 1000 by default) are never split. Since a batch
%% can be unfinished, `sys:get_state/1' returning does not mean that all batches
%% received so far were delivered.
%%
%% A publish entry (`convoy_wire') is delivered to the scope's local members as
%% `pg' has them when the inbox reaches the entry (one ETS read), in slices of
%% members like any other work: each send costs the words of the message + 32
%% (`convoy_wire:send_words/1'), a slice sends to as many members as its budget
%% allows (at least one), and the entries after it wait, so order holds for
%% everything the same node sent after it.
%%
%% Runs. Publish entries to the same group, or multicast entries to the same
%% destinations, one after the other in a batch (many senders fanning out to the
%% same processes at once) are delivered destination by destination: each gets
%% the run's messages back to back, in order, so it is woken once for all of them
%% rather than once per entry (a dispatcher doing the same for 100 messages to
%% 5000 processes on each of two nodes took about half the time, on 2 cores),
%% and a pid's incarnation is checked once per run. Nothing comes between the
%% entries of a run, so every destination still gets them in order and before
%% whatever follows. Only for destinations listed once each (a process listed
%% twice gets every message twice, one after the other, as without runs); a run
%% lasts while one destination's sends stay within the budget, and is delivered
%% in slices of destinations like a publish entry.
%%
%% A pid or alias of an old incarnation of this node (same name, another
%% `creation': one from before this node restarted) is counted as `undeliverable'
%% and not sent to, as `!' drops it silently on the sending node; a local send
%% would make the runtime log an error report for each message. Each pid or alias
%% is checked (`convoy_wire:creation/1', about 30 ns) unless it is the last one
%% found current in the same slice, so a run of entries to one process pays for
%% one check.
%%
%% Pieces of large messages (version 2, `convoy_chunk') are stored and acked by
%% `convoy_chunk_rx' as they come; the last one delivers the whole message in its
%% place. The inbox monitors the sender named in a message's first piece (its
%% keeper, see `convoy_chunk_send'): its `DOWN' (and a `nodedown') discards the
%% partial message, and so does its moving on without it (it no longer monitors
%% the inbox). Only a `DOWN' of a monitor the
%% inbox holds, and a `nodedown' of a node that is not connected, are acted on;
%% any other is counted (`unknown_message'), as anyone may send them.
-module(convoy_inbox).

-export([start_link/2, init/3, system_continue/3, system_terminate/4,
         system_get_state/1, system_code_change/4]).

%% The rest of a batch: its node's counters and entries, the first of them perhaps
%% already checked.
-type job() :: {counters:counters_ref(), checked() | none, maybe_improper_list()}.
%% An entry checked, or what is left of a run of publish entries: the members
%% still to send to, the run's messages and what sending them to one member costs.
-type checked() :: convoy_wire:checked() | {members | dests, list(), [term()], pos_integer()}.

-record(s, {parent :: pid(),
            name :: atom(),
            local :: node(),
            peers = #{} :: #{node() => counters:counters_ref()},
            %% unfinished batches per node, oldest first; nodes take turns
            work = #{} :: #{node() => queue:queue(job())},
            turns = queue:new() :: queue:queue(node())}).

%% What delivering a batch needs: the node it came from, this node and its
%% creation, and the last pid or alias found to be of this incarnation.
-record(d, {from :: node(),
            local :: node(),
            creation :: non_neg_integer(),
            good :: pid() | reference() | undefined}).

%% @doc Inbox `Index' of `Inboxes'.
-spec start_link(pos_integer(), pos_integer()) -> {ok, pid()}.
start_link(Index, Inboxes) ->
    proc_lib:start_link(?MODULE, init, [self(), Index, Inboxes]).

-spec init(pid(), pos_integer(), pos_integer()) -> no_return().
init(Parent, Index, Inboxes) ->
    Name = convoy_wire:inbox_name(Index),
    register(Name, self()),
    ok = convoy_chunk_rx:init(Index, Inboxes),
    process_flag(message_queue_data, off_heap),
    process_flag(trap_exit, true),
    ok = net_kernel:monitor_nodes(true),
    proc_lib:init_ack(Parent, {ok, self()}),
    loop(#s{parent = Parent, name = Name, local = node()}).

%% With unfinished batches: one message, then one slice, in turn.
loop(S = #s{parent = Parent}) ->
    Wait = case queue:is_empty(S#s.turns) of
               true -> infinity;
               false -> 0
           end,
    receive
        {system, From, Req} ->
            sys:handle_system_msg(Req, From, Parent, ?MODULE, [], S);
        {'EXIT', Parent, Reason} ->
            exit(Reason);
        Msg when Wait =:= 0 ->
            loop(slice(handle(Msg, S)));
        Msg ->
            loop(handle(Msg, S))
    after Wait ->
        loop(slice(S))
    end.

handle({nodedown, Node}, S) when is_atom(Node) ->
    case lists:member(Node, nodes(connected)) of
        false ->
            ok = convoy_chunk_rx:nodedown(Node),
            S#s{peers = maps:remove(Node, S#s.peers)};
        true ->
            %% Forged, or from before a reconnection (whose monitors of the node's
            %% senders fired then): nothing to discard.
            convoy_metrics:rejected(unknown_message),
            S
    end;
handle({'DOWN', Mon, process, Pid, _Reason}, S) when is_reference(Mon), is_pid(Pid) ->
    %% Only senders of messages in pieces are monitored (convoy_chunk_rx).
    case convoy_chunk_rx:down(Mon, Pid) of
        true -> ok;
        false -> convoy_metrics:rejected(unknown_message)
    end,
    S;
handle({nodeup, Node}, S) when is_atom(Node) ->
    S;
handle({timeout, TRef, convoy_chunk_tick}, S) when is_reference(TRef) ->
    %% the tick of messages in pieces (convoy_chunk_rx)
    case convoy_chunk_rx:tick(TRef, maps:keys(S#s.work)) of
        true -> ok;
        false -> convoy_metrics:rejected(unknown_message)
    end,
    S;
handle(Msg, S) ->
    case convoy_wire:decode(Msg) of
        {batch, _Vsn, From, Entries} ->
            case peer(From, S) of
                {ok, C, S1} ->
                    batch(From, {C, none, Entries}, S1);
                unknown ->
                    convoy_metrics:rejected(unknown_node),
                    S
            end;
        {error, Kind} ->
            convoy_metrics:rejected(Kind),
            S;
        {_HelloOrWelcome, _} ->
            convoy_metrics:rejected(unknown_message),
            S
    end.

%% A batch must come from a connected peer (it cannot come from anywhere else).
%% The node's counters are cached until its nodedown: convoy_peers forgets only
%% rows of nodes that are not connected, so a cached row is never a forgotten one.
%% With no convoy_peers (convoy's tree is being torn down) counts go to counters
%% nobody reads.
peer(Node, S = #s{peers = Peers}) ->
    case Peers of
        #{Node := C} ->
            {ok, C, S};
        _ ->
            case lists:member(Node, nodes(connected)) of
                true ->
                    case convoy_peers:refs(Node) of
                        undefined ->
                            {ok, element(1, convoy_metrics:new_refs()), S};
                        {C, _H} ->
                            {ok, C, S#s{peers = Peers#{Node => C}}}
                    end;
                false ->
                    unknown
            end
    end.

%% A new batch: behind the node's unfinished ones, or its first slice now.
batch(From, Job, S = #s{work = Work}) ->
    case Work of
        #{From := Q} ->
            S#s{work = Work#{From := queue:in(Job, Q)}};
        _ ->
            case run(Job, From, S) of
                done -> S;
                Rest -> S#s{work = Work#{From => queue:from_list([Rest])},
                            turns = queue:in(From, S#s.turns)}
            end
    end.

%% One slice of the unfinished batch of the node whose turn it is.
slice(S = #s{work = Work, turns = Turns}) ->
    case queue:out(Turns) of
        {empty, _} ->
            S;
        {{value, Node}, Turns1} ->
            {{value, Job}, Q} = queue:out(maps:get(Node, Work)),
            Q1 = case run(Job, Node, S) of
                     done -> Q;
                     Rest -> queue:in_r(Rest, Q)
                 end,
            case queue:is_empty(Q1) of
                true -> S#s{work = maps:remove(Node, Work), turns = Turns1};
                false -> S#s{work = Work#{Node := Q1}, turns = queue:in(Node, Turns1)}
            end
    end.

%% Deliver entries of a job for at most one slice; returns what is left of it.
run({C, First, Entries}, From, #s{local = Local}) ->
    D = #d{from = From, local = Local, creation = erlang:system_info(creation)},
    Budget = convoy_wire:max_entry_words(),
    {N, Left} = case First of
                    none -> deliver(Entries, D, Budget, Budget, 0);
                    _ -> step(First, Entries, D, Budget, Budget, 0)
                end,
    convoy_metrics:add(C, received, N),
    case Left of
        done -> done;
        {Checked, Rest} -> {C, Checked, Rest}
    end.

%% N counts messages delivered (one per send or multicast entry); stops at an
%% improper tail. Left is what the slice has still to spend of Budget.
deliver([], _D, _Left, _Budget, N) ->
    {N, done};
deliver([E | Rest], D, Left, Budget, N) ->
    step(convoy_wire:entry(E, D#d.from, D#d.local), Rest, D, Left, Budget, N);
deliver(_ImproperTail, _D, _Left, _Budget, N) ->
    convoy_metrics:rejected(malformed_batch),
    {N, done}.

step({Kind, Tos, Msgs, Each}, Rest, D, Left, Budget, N) when Kind =:= members;
                                                              Kind =:= dests ->
    %% A run's sends (one publish entry is a run of one), to as many destinations
    %% as this slice has room for (at least one in a whole slice); the rest wait
    %% for the next slices, ahead of Rest.
    case convoy_wire:take_members(Tos, Each, Left) of
        {Now, []} ->
            deliver(Rest, send_run(Kind, Now, Msgs, D), Left - length(Now) * Each, Budget, N);
        {Now, Later} ->
            _ = send_run(Kind, Now, Msgs, D),
            {N, {{Kind, Later, Msgs, Each}, Rest}}
    end;
step(Checked, Rest, D, Left, Budget, N) ->
    Cost = convoy_wire:cost(Checked),
    case Cost > Left andalso Left < Budget of
        true ->
            {N, {Checked, Rest}};
        false ->
            case Checked of
                {deliver, To, Msg} ->
                    deliver(Rest, local_send(To, Msg, D), Left - Cost, Budget, N + 1);
                {multicast, Tos, Msg, _} ->
                    case multicast_run(Tos, Msg, Cost, Rest, Budget) of
                        none ->
                            deliver(Rest, multicast(Tos, Msg, D), Left - Cost, Budget, N + 1);
                        {Msgs, Each, K, Rest1} ->
                            step({dests, Tos, Msgs, Each}, Rest1, D, Left, Budget, N + K)
                    end;
                {publish, Scope, Group, Msg} ->
                    case convoy_pg:local_members(Scope, Group) of
                        {ok, Members} ->
                            {Msgs, Each, K, Rest1} = publish_run(Members, Scope, Group, Msg,
                                                                 Rest, D, Budget),
                            step({members, Members, Msgs, Each}, Rest1, D, Left - Cost, Budget,
                                 N + K);
                        no_scope ->
                            convoy_metrics:rejected(undeliverable),
                            deliver(Rest, D, Left - Cost, Budget, N)
                    end;
                {barrier, ReplyTo, Tag} ->
                    _ = erlang:send(ReplyTo, {Tag, convoy_barrier}, [noconnect]),
                    deliver(Rest, D, Left - Cost, Budget, N);
                {piece, _, _, _} = P ->
                    piece(P, Rest, D, Left - Cost, Budget, N);
                {piece_start, _} = P ->
                    piece(P, Rest, D, Left - Cost, Budget, N);
                {error, Kind} ->
                    convoy_metrics:rejected(Kind),
                    deliver(Rest, D, Left - Cost, Budget, N)
            end
    end.

%% Runs: entries right after one that send to the same destinations (a publish
%% entry to the same group, or a multicast entry to the same list), delivered
%% destination by destination: each gets the run's messages back to back, in
%% order. Only when no destination is listed twice (else a second copy of the
%% first message would come after the second message); a run lasts while one
%% destination's sends of all its messages (Each) stay within the budget. Every
%% entry is checked as any other: the first that does not continue the run ends
%% it and is handled in turn.

%% A publish entry's run: its messages, Each, how many entries, what follows.
publish_run(Members, Scope, Group, Msg, Rest, D, Budget) ->
    Each = convoy_wire:send_words(Msg),
    Next = fun(E) ->
                   case convoy_wire:entry(E, D#d.from, D#d.local) of
                       {publish, Scope, Group, M} -> {ok, M, convoy_wire:send_words(M)};
                       _ -> stop
                   end
           end,
    case Rest of
        [E | _] ->
            case Next(E) =/= stop andalso distinct(Members) of
                true -> run(Rest, Next, [Msg], Each, 1, Budget);
                false -> {[Msg], Each, 1, Rest}
            end;
        _ ->
            {[Msg], Each, 1, Rest}
    end.

%% A multicast entry's run (two or more destinations), or none.
multicast_run(Tos, Msg, Cost, Rest, Budget) ->
    N = length(Tos),
    Next = fun(E) ->
                   case convoy_wire:entry_to(E, Tos, N) of
                       {multicast, _, M, C} -> {ok, M, C div N};
                       _ -> stop
                   end
           end,
    case Rest of
        [E | _] when N >= 2 ->
            case Next(E) =/= stop andalso distinct(Tos) of
                true -> run(Rest, Next, [Msg], Cost div N, 1, Budget);
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

%% (A scope's row that is not pg's may hold an improper list: not distinct.)
distinct(L) ->
    try length(L) of
        Len -> length(lists:usort(L)) =:= Len
    catch
        error:badarg -> false
    end.

send_run(members, Members, Msgs, D) ->
    publish(Members, Msgs, D#d.local),
    D;
send_run(dests, Tos, Msgs, D) ->
    lists:foldl(fun(To, D1) -> lists:foldl(fun(M, D2) -> local_send(To, M, D2) end, D1, Msgs) end,
                D, Tos).

%% pg's local members are pids of this node's incarnation; anything else (a table
%% that is not pg's after all) is skipped. Each member gets the run's messages
%% back to back. Members come from convoy_wire:take_members/3, which ends an
%% improper list where it stops.
publish(Members, [Msg], Local) ->
    publish_one(Members, Msg, Local);
publish([], _Msgs, _Local) -> ok;
publish([P | Ps], Msgs, Local) when is_pid(P), node(P) =:= Local ->
    send_all(P, Msgs),
    publish(Ps, Msgs, Local);
publish([_ | Ps], Msgs, Local) -> publish(Ps, Msgs, Local).

%% One message (a publish entry alone, the usual case).
publish_one([P | Ps], Msg, Local) when is_pid(P), node(P) =:= Local ->
    P ! Msg,
    publish_one(Ps, Msg, Local);
publish_one([_ | Ps], Msg, Local) -> publish_one(Ps, Msg, Local);
publish_one([], _Msg, _Local) -> ok.

send_all(_P, []) -> ok;
send_all(P, [Msg | Msgs]) -> P ! Msg, send_all(P, Msgs).

%% A piece of a message sent in pieces (convoy_chunk_rx): the last one delivers
%% the whole message here, in this entry's place.
piece(P, Rest, D, Left, Budget, N) ->
    case convoy_chunk_rx:handle(P, D#d.from) of
        none ->
            deliver(Rest, D, Left, Budget, N);
        {deliver, To, Msg, Ref} ->
            D1 = local_send(To, Msg, D),
            ok = convoy_chunk_rx:delivered(Ref),
            deliver(Rest, D1, Left, Budget, N + 1)
    end.

multicast([], _Msg, D) -> D;
multicast([To | Tos], Msg, D) -> multicast(Tos, Msg, local_send(To, Msg, D)).

%% Like `!' to a remote name: a name nobody holds drops the message (counted). A
%% pid or alias of an old incarnation of this node is dropped as `!' would on the
%% sending node (counted), without the error report a local send makes the runtime
%% log. Returns D, remembering a pid or alias found current.
local_send(To, Msg, D) when is_atom(To) ->
    try
        erlang:send(To, Msg)
    catch
        error:badarg -> convoy_metrics:rejected(undeliverable)
    end,
    D;
local_send(To, Msg, D = #d{good = To}) ->
    erlang:send(To, Msg),
    D;
local_send(To, Msg, D = #d{creation = Creation}) ->
    case convoy_wire:creation(To) of
        Creation ->
            erlang:send(To, Msg),
            D#d{good = To};
        unknown ->
            erlang:send(To, Msg),
            D;
        _Old ->
            convoy_metrics:rejected(undeliverable),
            D
    end.

-spec system_continue(pid(), [sys:debug_option()], #s{}) -> no_return().
system_continue(_Parent, _Debug, S) -> loop(S).

-spec system_terminate(term(), pid(), [sys:debug_option()], #s{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, _S) -> exit(Reason).

-spec system_get_state(#s{}) -> {ok, #s{}}.
system_get_state(S) -> {ok, S}.

-spec system_code_change(#s{}, module(), term(), term()) -> {ok, #s{}}.
system_code_change(S, _Module, _OldVsn, _Extra) -> {ok, S}.
