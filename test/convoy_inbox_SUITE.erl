%% What an inbox does with batches that are well-formed but ask too much of it, with
%% peer nodes: barriers naming a process on a third node, multicasts over the
%% limits, long batches that would hold other nodes' traffic, and destinations of
%% an old incarnation of the receiving node. Batches are built by hand (the wire
%% format in convoy_wire), as a stray or malformed one would arrive.
-module(convoy_inbox_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([barrier_for_third_node/1, huge_multicast_rejected/1, long_batch_yields/1,
         old_incarnation_not_logged/1, old_incarnation_through_convoy/1,
         nested_batch_rejected/1, sender_splits_multicast/1]).
%% Run on peer nodes, or spawned.
-export([recorder/0, send_with_barrier/3, make_ids/0, log/2]).

-define(INBOX, convoy_inbox_1).

suite() ->
    [{timetrap, {seconds, 120}}].

all() ->
    [barrier_for_third_node, huge_multicast_rejected, long_batch_yields,
     old_incarnation_not_logged, old_incarnation_through_convoy, nested_batch_rejected,
     sender_splits_multicast].

init_per_testcase(_TC, Config) ->
    ok = convoy_ct_peers:restart_here(),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------
%% Test cases

%% A barrier's ReplyTo must be a process (pid or alias) of the node the batch comes
%% from. A batch from A whose barriers name a process on C used to make this node's
%% inbox send to C on A's behalf; now they are bad entries and C gets nothing. A
%% barrier for A itself is still answered.
barrier_for_third_node(_Config) ->
    {PeerA, A} = peer(?CT_PEER_NAME(sender_a)),
    {_PeerC, C} = peer(?CT_PEER_NAME(third_c)),
    Rec = spawn(C, ?MODULE, recorder, []),
    AliasC = ask(Rec, alias),
    Inbox = whereis(?INBOX),
    Before = rejected(),
    Entries = [{'$convoy_barrier', Rec, to_c_pid}, {'$convoy_barrier', AliasC, to_c_alias}],
    ?assertEqual(ok, peer:call(PeerA, ?MODULE, send_with_barrier, [{?INBOX, node()}, A, Entries])),
    ?assertEqual(2, maps:get(bad_entry, rejected()) - maps:get(bad_entry, Before)),
    %% Anything the inbox sent to C before answering A travels on this node's
    %% connection to C ahead of this probe.
    Rec ! probe,
    ?assertEqual([probe], ask(Rec, received)),
    ?assertEqual(Inbox, whereis(?INBOX)).

%% One entry with a million destinations and a 100,000-deep term stalled an inbox
%% for about 19 minutes: it copied the term (200,000 words) to each destination in
%% turn, and nothing else got through meanwhile. Here the destinations are one live
%% process, so that delivering such an entry means copying: a million copies, or,
%% in the second entry, 100 copies within the destination limit but over the copy
%% budget. Both are rejected (too_costly, nothing of them sent), and the rest of
%% the batch and another node's batch queued behind it are delivered before
%% anything else reaches that process.
huge_multicast_rejected(_Config) ->
    {_PeerA, A} = peer(?CT_PEER_NAME(sender_a)),
    {_PeerB, B} = peer(?CT_PEER_NAME(sender_b)),
    Rec = spawn_link(?MODULE, recorder, []),
    Deep = lists:foldl(fun(_, Acc) -> [Acc] end, [], lists:seq(1, 100000)),
    Huge = {lists:duplicate(1000000, Rec), Deep},
    Costly = {lists:duplicate(100, Rec), Deep},  % 100 x 200,000 words
    Inbox = whereis(?INBOX),
    Before = rejected(),
    %% Both batches wait in the inbox's mailbox, the costly one first.
    ok = sys:suspend(Inbox),
    Inbox ! batch(A, [Huge, Costly, {Rec, {a, after_costly}}]),
    Inbox ! batch(B, [{Rec, {b, only}}]),
    ok = sys:resume(Inbox),
    %% A copy of the deep term is recorded as `deep' (see recorder/3); one sent
    %% for A's costly entries would reach the process before A's last entry.
    ?assertEqual([{a, after_costly}, {b, only}], lists:sort(await_received(Rec, 2))),
    ?assertEqual(2, maps:get(too_costly, rejected()) - maps:get(too_costly, Before)),
    ?assertEqual(Inbox, whereis(?INBOX)).

%% A batch of entries that each cost close to the limit is delivered in slices:
%% a batch from another node that arrives meanwhile is delivered before the long
%% one ends, and the long one's entries still arrive in order.
long_batch_yields(_Config) ->
    {_PeerA, A} = peer(?CT_PEER_NAME(sender_a)),
    {_PeerB, B} = peer(?CT_PEER_NAME(sender_b)),
    Rec = spawn_link(?MODULE, recorder, []),
    Payload = lists:seq(1, 50000), % 100,000 words: two sends cost 200,064 of 2^18
    Long = [{[Rec, Rec], {a, I, Payload}} || I <- lists:seq(1, 6)] ++ [{Rec, {a, last}}],
    Inbox = whereis(?INBOX),
    %% Both batches wait in the inbox's mailbox, the long one first.
    ok = sys:suspend(Inbox),
    Inbox ! batch(A, Long),
    Inbox ! batch(B, [{Rec, {b, only}}]),
    ok = sys:resume(Inbox),
    Got = await_received(Rec, 14),
    ct:pal("delivered: ~p", [Got]),
    ALast = length(lists:takewhile(fun(M) -> M =/= {a, last} end, Got)),
    BAt = length(lists:takewhile(fun(M) -> M =/= {b, only} end, Got)),
    ?assert(BAt < ALast),
    ?assertEqual([{a, I} || I <- lists:seq(1, 6), _ <- [1, 2]] ++ [{a, last}],
                 [M || M <- Got, element(1, M) =:= a]),
    ?assertEqual(Inbox, whereis(?INBOX)).

%% Messages to pids and aliases of a restarted node's old incarnation reach the new
%% incarnation's inbox. A local send to them makes the runtime log an error report
%% per message; the inbox now counts them as undeliverable and sends nothing,
%% single and multicast destinations alike.
old_incarnation_not_logged(_Config) ->
    #{peer := Peer2, node := Node, old_pid := OldPid, old_alias := OldAlias, live := Live,
      log := Log} = restarted_peer(),
    Before = peer:call(Peer2, convoy_metrics, rejected, []),
    Entries = [{OldPid, m1}, {[Live, OldPid, OldAlias, Live], m2}, {OldAlias, m3}, {Live, m4}],
    ok = send_with_barrier({?INBOX, Node}, node(), Entries),
    nothing_logged_about_old_incarnation(Peer2, Log),
    After = peer:call(Peer2, convoy_metrics, rejected, []),
    ?assertEqual(4, maps:get(undeliverable, After) - maps:get(undeliverable, Before)),
    ?assertEqual([m2, m2, m4], ask(Live, received)).

%% A peer started again under the same name (a new incarnation, checked), running
%% convoy, with a logger handler reporting to a recorder there (`log') and a live
%% recorder (`live'); `old_pid' and `old_alias' were made by its first incarnation.
restarted_peer() ->
    Name = ?CT_PEER_NAME(),
    {Peer1, Node} = peer(Name),
    {OldPid, OldAlias, Creation1} = peer:call(Peer1, ?MODULE, make_ids, []),
    peer:stop(Peer1),
    await(fun() -> lists:member(Node, nodes()) end, fun(Up) -> not Up end, 10000),
    {Peer2, Node} = peer(Name),
    ok = convoy_ct_peers:start_convoy(Peer2, #{}),
    ?assertNotEqual(Creation1, peer:call(Peer2, erlang, system_info, [creation])),
    Log = spawn(Node, ?MODULE, recorder, []),
    ok = peer:call(Peer2, logger, add_handler, [convoy_inbox_suite, ?MODULE, #{config => #{to => Log}}]),
    #{peer => Peer2, node => Node, old_pid => OldPid, old_alias => OldAlias, log => Log,
      live => spawn(Node, ?MODULE, recorder, [])}.

%% The runtime's error reports go through the logger process: once it has handled
%% what was sent before (and a control event after), the handler has seen them.
nothing_logged_about_old_incarnation(Peer, Log) ->
    _ = peer:call(Peer, sys, get_state, [logger]),
    ok = peer:call(Peer, logger, error, ["convoy_inbox_SUITE control event"]),
    Events = [format_event(E) || E <- ask(Log, received)],
    ct:pal("logged on the new incarnation: ~p", [Events]),
    ?assert(lists:any(fun(E) -> string:find(E, "control event") =/= nomatch end, Events)),
    ?assertEqual([], [E || E <- Events, string:find(E, "old incarnation") =/= nomatch]).

%% The same through convoy's own path, as the issue found it: this node's
%% convoy:send/2 and multicast/2 to pids of the peer's old incarnation, every
%% message through a lane, reach the new incarnation's inbox, which counts them as
%% undeliverable and logs nothing; a live process's messages around them arrive.
old_incarnation_through_convoy(_Config) ->
    ok = convoy:set_config(#{bypass_after => never}),
    #{peer := Peer2, node := Node, old_pid := OldPid, old_alias := OldAlias, live := Live,
      log := Log} = restarted_peer(),
    convoy_ct_peers:await_route(Node, convoy),
    Before = peer:call(Peer2, convoy_metrics, rejected, []),
    ok = convoy:send(Live, m1),
    ok = convoy:send(OldPid, m2),
    ok = convoy:multicast([Live, OldPid, OldAlias], m3),
    ok = convoy:send(OldAlias, m4),
    ok = convoy:send(Live, m5),
    ok = convoy:flush(Node),
    ?assertEqual([m1, m3, m5], await_received(Live, 3)),
    %% Everything before m5 was handled by the inbox (one lane, one inbox, in order).
    nothing_logged_about_old_incarnation(Peer2, Log),
    After = peer:call(Peer2, convoy_metrics, rejected, []),
    ?assertEqual(4, maps:get(undeliverable, After) - maps:get(undeliverable, Before)).

%% An entry whose message is itself a batch, multicast to the inbox many times,
%% made the inbox feed itself: each level multiplies the work of one input, each
%% level within the cost limit. Such multicasts are bad entries. In a plain
%% entry a batch is a message like any other (any term is): delivered to a
%% process, and to an inbox as the smaller input its sender could have sent
%% there itself.
nested_batch_rejected(_Config) ->
    {_PeerA, A} = peer(?CT_PEER_NAME(sender_a)),
    Sink = spawn_link(fun() -> counter(0) end),
    After = spawn_link(fun() -> counter(0) end),
    Keeper = spawn_link(fun() -> receive {get, From} -> receive M -> From ! {got, M} end end end),
    Inner = batch(A, [{Sink, inner}]),
    Before = rejected(),
    ?INBOX ! batch(A, [{?INBOX, Inner}, {lists:duplicate(64, ?INBOX), Inner},
                       {whereis(?INBOX), Inner}, {Keeper, Inner}, {After, ok}]),
    ?assertEqual(1, await_count(After, 1, 10000)),
    %% The inbox has handled anything it could have sent itself.
    _ = sys:get_state(?INBOX),
    ?assertEqual(2, count(Sink)),
    ?assertEqual(1, maps:get(bad_entry, rejected()) - maps:get(bad_entry, Before)),
    Keeper ! {get, self()},
    ?assertEqual(Inner, receive {got, M} -> M after 5000 -> none end).

%% A sender splits a multicast to one node into entries the inbox accepts: 10,000
%% destinations of a 200-word message (2.3 M word copies, nine times the limit of
%% one entry) all get it and the receiver rejects nothing.
sender_splits_multicast(_Config) ->
    {Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(receiver), #{}),
    Rec = spawn(Node, fun() -> counter(0) end),
    Before = peer:call(Peer, convoy_metrics, rejected, []),
    Msg = {multi, lists:seq(1, 100)},
    ok = convoy:multicast(lists:duplicate(10000, Rec), Msg),
    ok = convoy:multicast([Rec], last),
    ?assertEqual(10001, await_count(Rec, 10001, 20000)),
    ?assertEqual(Before, peer:call(Peer, convoy_metrics, rejected, [])).

%%--------------------------------------------------------------------
%% Helpers

peer(Name) ->
    convoy_ct_peers:start(?MODULE, Name, #{}).

await(Get, Ok, Timeout) ->
    convoy_ct_peers:await(Get, Ok, Timeout).

batch(From, Entries) ->
    {'$convoy', 1, batch, From, Entries}.

rejected() ->
    maps:get(rejected, convoy:info()).

%% Send Entries and then a barrier for this process as a batch from node From to
%% Inbox; ok once the barrier is answered (everything before it is delivered).
send_with_barrier(Inbox, From, Entries) ->
    Tag = make_ref(),
    Inbox ! batch(From, Entries ++ [{'$convoy_barrier', self(), Tag}]),
    receive
        {Tag, convoy_barrier} -> ok
    after 20000 ->
        barrier_timeout
    end.

%% A process, an alias and the creation of this node.
make_ids() ->
    {spawn(fun() -> receive stop -> ok end end), alias(), erlang:system_info(creation)}.

%% recorder: keeps what it receives; answers `{'$q', alias | received, From}' and
%% `{'$q', await, N, From}' (once it holds N messages).
recorder() ->
    recorder([], alias(), []).

recorder(Got, Alias, Waiters) ->
    receive
        {'$q', alias, From} ->
            From ! {'$a', self(), Alias},
            recorder(Got, Alias, Waiters);
        {'$q', received, From} ->
            From ! {'$a', self(), lists:reverse(Got)},
            recorder(Got, Alias, Waiters);
        {'$q', await, N, From} ->
            recorder(Got, Alias, answer(Got, [{N, From} | Waiters]));
        {a, I, _Payload} ->
            recorder([{a, I} | Got], Alias, answer([{a, I} | Got], Waiters));
        {log_event, E} ->
            recorder([E | Got], Alias, Waiters);
        L when is_list(L) -> % a copy of a large term: not kept
            recorder([deep | Got], Alias, answer([deep | Got], Waiters));
        M ->
            recorder([M | Got], Alias, answer([M | Got], Waiters))
    end.

answer(Got, Waiters) ->
    {Done, Left} = lists:partition(fun({N, _}) -> length(Got) >= N end, Waiters),
    [From ! {'$a', self(), lists:reverse(Got)} || {_, From} <- Done],
    Left.

ask(Rec, What) ->
    Rec ! {'$q', What, self()},
    receive {'$a', Rec, A} -> A after 10000 -> ct:fail({no_answer, Rec, What}) end.

await_received(Rec, N) ->
    Rec ! {'$q', await, N, self()},
    receive {'$a', Rec, A} -> A after 30000 -> ct:fail({short, Rec, N, ask(Rec, received)}) end.

counter(N) ->
    receive
        {'$q', count, From} ->
            From ! {'$a', self(), N},
            counter(N);
        _ ->
            counter(N + 1)
    end.

count(C) ->
    C ! {'$q', count, self()},
    receive {'$a', C, N} -> N after 10000 -> ct:fail({no_answer, C}) end.

await_count(C, N, Timeout) ->
    await(fun() -> count(C) end, fun(V) -> V >= N end, Timeout).

%% A logger handler (installed on a peer): forwards every event.
log(Event, #{config := #{to := To}}) ->
    To ! {log_event, Event},
    ok.

format_event(#{msg := {string, S}}) -> unicode:characters_to_list(S);
format_event(#{msg := {report, R}}) -> lists:flatten(io_lib:format("~p", [R]));
format_event(#{msg := {Format, Args}}) -> lists:flatten(io_lib:format(Format, Args)).
