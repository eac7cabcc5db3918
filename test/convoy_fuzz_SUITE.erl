%% Untrusted input: a peer node throws generated bad input at this node's convoy
%% processes (inboxes, convoy_peers) and this node throws random terms at its own
%% lanes. Afterwards every convoy process must be the same process as before
%% (nothing crashed or restarted), the `rejected' counters must have gone up by
%% exactly what the protocol says each input deserves, what the valid entries of
%% the fuzzed batches asked for must have been delivered, and real traffic must
%% still arrive complete and in order in both directions.
%%
%% The generator is a plain seeded random term generator (rand, exsss). The seed is
%% printed; rerun with CONVOY_FUZZ_SEED="{A,B,C}" to replay a run. The expected
%% effect of every input is computed by an oracle written from the protocol
%% description in convoy_wire, not from convoy's code.
-module(convoy_fuzz_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, groups/0, suite/0, init_per_suite/1, end_per_suite/1,
         init_per_group/2, end_per_group/2]).
-export([fuzz_inboxes/1, fuzz_peers/1, fuzz_lanes/1, nothing_restarted/1,
         traffic_after_fuzz/1,
         improper_list_message/1, forged_nodeup_to_peers/1]).
%% Run on the peer nodes.
-export([counter/0, seq_sender/3, fuzz_inboxes_remote/2,
         fuzz_peers_remote/2, make_pid/2, send_then_barrier/2]).

-define(SINK, convoy_fuzz_sink).
-define(INBOX_INPUTS, 6000).
-define(PEERS_INPUTS, 2500).
-define(PEERS_CALLS, 500).
-define(LANE_INPUTS, 1000).
-define(TRAFFIC, 10000).
-define(DEFAULT_SEED, {20240601, 17, 4242}).
%% The pg scope running here, and the group the sink is the only member of.
-define(PG_SCOPE, convoy_fuzz_pg).
-define(PG_GROUP, convoy_fuzz_group).

%% A message kind on the rejected counters, and all of them.
-define(KINDS, [bad_version, malformed_batch, bad_entry, bad_hello, unknown_message,
                unknown_node, undeliverable, too_costly, unsolicited, bad_piece,
                partial_discarded, reassembly_full, bad_compressed]).

suite() ->
    [{timetrap, {seconds, 60}}].

all() ->
    [{group, fuzz}, {group, regressions}].

groups() ->
    [{fuzz, [sequence], [fuzz_inboxes, fuzz_peers, fuzz_lanes, nothing_restarted,
                         traffic_after_fuzz]},
     %% Each of these reproduces a bug fuzzing found (fixed; see the test case).
     {regressions, [], [improper_list_message, forged_nodeup_to_peers]}].

%%--------------------------------------------------------------------
%% Set-up: this node runs convoy with 2 lanes (2 inboxes); peer A runs convoy and
%% is the attacker; peer B runs convoy and sends real traffic during the fuzzing.

init_per_suite(Config) ->
    Seed = seed(),
    ct:pal("fuzz seed ~p (set CONVOY_FUZZ_SEED=\"~p\" to replay)", [Seed, Seed]),
    [{seed, Seed} | Config].

end_per_suite(_Config) ->
    ok.

seed() ->
    case os:getenv("CONVOY_FUZZ_SEED") of
        false ->
            ?DEFAULT_SEED;
        S ->
            {ok, Tokens, _} = erl_scan:string(S ++ "."),
            {ok, Seed} = erl_parse:parse_term(Tokens),
            Seed
    end.

init_per_group(_Group, Config) ->
    _ = application:stop(convoy),
    ok = application:set_env(convoy, lanes, 2),
    {ok, _} = application:ensure_all_started(convoy),
    Args = ["-pa", code:lib_dir(convoy, ebin), "-pa", filename:dirname(code:which(?MODULE))],
    %% Driven over stdio (peer:call), connected over distribution.
    Opts = #{args => Args, connection => standard_io},
    {ok, PeerA, A} = ?CT_PEER(Opts#{name => ?CT_PEER_NAME(fuzz_attacker)}),
    {ok, PeerB, B} = ?CT_PEER(Opts#{name => ?CT_PEER_NAME(fuzz_sender)}),
    %% The peer controllers are linked to this (init_per_group) process, which ends.
    unlink(PeerA),
    unlink(PeerB),
    true = net_kernel:connect_node(A),
    true = net_kernel:connect_node(B),
    %% and A to B, so that both see the same connected set as this node
    true = peer:call(PeerA, net_kernel, connect_node, [B]),
    [{ok, _} = peer:call(P, application, ensure_all_started, [convoy]) || P <- [PeerA, PeerB]],
    await_route(A, convoy),
    await_route(B, convoy),
    Sink = spawn(?MODULE, counter, []),
    true = register(?SINK, Sink),
    {ok, Scope} = pg:start(?PG_SCOPE), % not linked: outlives init_per_group
    ok = pg:join(?PG_SCOPE, ?PG_GROUP, Sink),
    [{peer_a, PeerA}, {a, A}, {peer_b, PeerB}, {b, B}, {sink, Sink}, {pg_scope, Scope},
     {processes, convoy_processes()} | Config].

end_per_group(_Group, Config) ->
    exit(?config(sink, Config), kill),
    ok = gen_server:stop(?config(pg_scope, Config)),
    [catch peer:stop(?config(P, Config)) || P <- [peer_a, peer_b]],
    _ = application:stop(convoy),
    application:unset_env(convoy, lanes),
    ok.

%%--------------------------------------------------------------------
%% Test cases

%% From peer A: malformed batches, unknown versions, random terms, batches claiming
%% nodes that are not connected, batches with bad entries and improper lists,
%% entries for names nobody holds, hellos; to both inboxes. Meanwhile peer B sends
%% real traffic to a collector here.
fuzz_inboxes(Config) ->
    A = ?config(a, Config),
    B = ?config(b, Config),
    Collector = spawn_link(convoy_ct_seq, collector, []),
    Traffic = spawn(B, ?MODULE, seq_sender, [Collector, ?TRAFFIC, self()]),
    Before = rejected(),
    ReceivedBefore = received([A, B]),
    SinkBefore = counter_value(?config(sink, Config)),
    Ctx = ctx(Config),
    {Inputs, Expect} = peer:call(?config(peer_a, Config), ?MODULE, fuzz_inboxes_remote,
                                 [Ctx, ?INBOX_INPUTS], 50000),
    ct:pal("~p inputs to the inboxes; expected ~p", [Inputs, Expect]),
    ?assert(Inputs >= ?INBOX_INPUTS),
    #{rejected := ExpRej, received := ExpRecv, sink := ExpSink} = Expect,
    ?assertEqual(ExpRej, delta(Before, rejected())),
    %% B's own traffic is counted as received from B too, as far as it went
    %% through the inbox (not when B's senders bypassed it).
    #{A := RecvA, B := RecvB} = delta(ReceivedBefore, received([A, B])),
    ?assertEqual(maps:get(A, ExpRecv), RecvA),
    ?assert(RecvB >= maps:get(B, ExpRecv) andalso RecvB =< maps:get(B, ExpRecv) + ?TRAFFIC),
    %% Everything the valid entries addressed to the sink (pid, name, alias) arrived.
    ?assertEqual(SinkBefore + ExpSink, await_counter(?config(sink, Config), SinkBefore + ExpSink)),
    %% B's real traffic during the fuzzing: complete and in order.
    receive {sent, Traffic, ?TRAFFIC} -> ok after 30000 -> ct:fail(traffic_sender_stuck) end,
    ?assertEqual({?TRAFFIC, []}, convoy_ct_seq:await(Collector, ?TRAFFIC)),
    ok.

%% From peer A: random terms, batches and bad hellos to convoy_peers, hellos from
%% nodes that are not connected, hellos and welcomes claiming A, B or others (with
%% any versions, pids, inbox counts and requests), forged DOWN, nodeup and nodedown
%% messages, and gen_server calls and casts with random terms. No route changes:
%% only a welcome answering this node's own request is learnt from.
fuzz_peers(Config) ->
    A = ?config(a, Config),
    B = ?config(b, Config),
    RouteA = convoy_peers:route(A),
    RouteB = convoy_peers:route(B),
    Before = rejected(),
    {Inputs, Expect} = peer:call(?config(peer_a, Config), ?MODULE, fuzz_peers_remote,
                                 [ctx(Config), ?PEERS_INPUTS], 50000),
    ct:pal("~p inputs to convoy_peers; expected ~p", [Inputs, Expect]),
    ?assert(Inputs >= ?PEERS_INPUTS + 2 * ?PEERS_CALLS),
    ?assertEqual(maps:get(rejected, Expect), delta(Before, rejected())),
    ?assertEqual(RouteA, convoy_peers:route(A)),
    ?assertEqual(RouteB, convoy_peers:route(B)),
    %% And A's convoy_peers learns us again from the welcome.
    await_remote_route(?config(peer_a, Config), node(), convoy),
    ok.

%% Locally: random terms to every lane.
fuzz_lanes(Config) ->
    rand:seed(exsss, ?config(seed, Config)),
    Ctx = ctx(Config),
    LaneInfo = maps:get(lanes, convoy:info()),
    Lanes = [P || #{pid := P} <- LaneInfo],
    %% two lanes for each node: the peers, A and B
    ?assertEqual(lists:sort([?config(a, Config), ?config(a, Config), ?config(b, Config),
                             ?config(b, Config)]),
                 lists:sort([N || #{node := N} <- LaneInfo])),
    Before = rejected(),
    N = lists:sum([begin
                       Sent = length([L ! lane_term(Ctx) || _ <- lists:seq(1, ?LANE_INPUTS)]),
                       _ = sys:get_state(L), % barrier: all of it handled
                       Sent
                   end || L <- Lanes]),
    ?assertEqual((zero())#{unknown_message := N}, delta(Before, rejected())),
    ok.

nothing_restarted(Config) ->
    ?assertEqual(?config(processes, Config), convoy_processes()),
    Info = convoy:info(),
    ?assertMatch(#{running := true}, Info),
    ct:pal("rejected after fuzzing: ~p", [maps:get(rejected, Info)]),
    %% Nothing was dropped or left behind on the way to either peer.
    [?assertMatch(#{dropped := 0, buffered := 0}, maps:get(N, maps:get(nodes, Info)))
     || N <- [?config(a, Config), ?config(b, Config)]],
    ok.

%% Real traffic both ways after the fuzzing: 10,000 messages from A to a process
%% here, and 10,000 from here to a process on A, complete and in order; counters
%% on both sides agree.
traffic_after_fuzz(Config) ->
    A = ?config(a, Config),
    PeerA = ?config(peer_a, Config),
    await_route(A, convoy),
    %% A -> here
    Here = spawn_link(convoy_ct_seq, collector, []),
    AStatsBefore = peer:call(PeerA, convoy, info, []),
    Sender = spawn(A, ?MODULE, seq_sender, [Here, ?TRAFFIC, self()]),
    receive {sent, Sender, ?TRAFFIC} -> ok after 30000 -> ct:fail(sender_on_a_stuck) end,
    ?assertEqual({?TRAFFIC, []}, convoy_ct_seq:await(Here, ?TRAFFIC)),
    AStatsAfter = peer:call(PeerA, convoy, info, []),
    #{accepted := Acc0, messages := M0, dropped := D0} = node_stats(AStatsBefore, node()),
    #{accepted := Acc1, messages := M1, dropped := D1, buffered := 0} =
        node_stats(AStatsAfter, node()),
    ?assertEqual({?TRAFFIC, ?TRAFFIC, 0}, {Acc1 - Acc0, M1 - M0, D1 - D0}),
    %% here -> A
    There = convoy_ct_seq:start(A),
    Before = node_stats(convoy:info(), A),
    seq_sender(There, ?TRAFFIC, none),
    ?assertEqual({?TRAFFIC, []}, convoy_ct_seq:await(There, ?TRAFFIC)),
    After = node_stats(convoy:info(), A),
    ?assertEqual(?TRAFFIC, maps:get(accepted, After) - maps:get(accepted, Before)),
    ?assertEqual(?TRAFFIC, maps:get(messages, After) - maps:get(messages, Before)),
    ?assertMatch(#{dropped := 0, buffered := 0}, After),
    %% and still nothing restarted
    ?assertEqual(?config(processes, Config), convoy_processes()),
    ok.

%%--------------------------------------------------------------------
%% Regressions: bugs fuzzing found, now fixed

%% convoy_size took an improper list whose tail is a 2-tuple, e.g. [a | {b, 1}], is
%% for the walker's own {Tuple, Index} stack frame: convoy_size:is_large/2 raised
%% badarg (or miscounted), so convoy:send/2 to a remote process raised where `!'
%% sends, after taking an admission it never disposed of.
improper_list_message(Config) ->
    A = ?config(a, Config),
    There = spawn(A, ?MODULE, counter, []),
    Msgs = [[a | {b, 1}], [a | {<<"x">>, y}], {wrapped, [1, 2 | {c, 2}]}],
    Results = [{M, catch convoy:send(There, M)} || M <- Msgs],
    ct:pal("convoy:send of improper lists: ~p", [Results]),
    ?assertEqual([{M, ok} || M <- Msgs], Results),
    ok = convoy:flush(),
    ?assertEqual(length(Msgs), await_counter(There, length(Msgs))).

%% A forged `{nodeup, Node, Info}' whose Node is not an atom, sent by any connected
%% node to the registered convoy_peers, crashed it in erlang:send/3 (badarg), and
%% convoy_sup (one_for_all) restarted all of convoy. Now counted as unknown_message.
forged_nodeup_to_peers(Config) ->
    Processes = convoy_processes(),
    Before = rejected(),
    ok = peer:call(?config(peer_a, Config), ?MODULE, send_then_barrier,
                   [{convoy_peers, node()}, {nodeup, 123, []}]),
    ?assertEqual(Processes, convoy_processes()),
    ?assertEqual(maps:get(unknown_message, Before) + 1, maps:get(unknown_message, rejected())).

%%--------------------------------------------------------------------
%% Helpers on this node

%% Every convoy process: registered ones, supervisor children, lanes, inboxes.
convoy_processes() ->
    Names = [convoy_sup, convoy_peers, convoy_control, convoy_inbox_sup, convoy_lane_sup,
             convoy_inbox_1, convoy_inbox_2],
    Registered = [{N, whereis(N)} || N <- Names],
    Children = lists:sort([{Sup, Id, Pid} || Sup <- [convoy_sup, convoy_inbox_sup, convoy_lane_sup],
                                            {Id, Pid, _, _} <- supervisor:which_children(Sup)]),
    Lanes = [P || #{pid := P} <- maps:get(lanes, convoy:info())],
    [?assert(is_pid(P) andalso is_process_alive(P)) || {_, P} <- Registered],
    [?assert(is_process_alive(P)) || P <- Lanes],
    {Registered, Children, Lanes}.

rejected() -> maps:get(rejected, convoy:info()).

zero() -> maps:from_list([{K, 0} || K <- ?KINDS]).

delta(Before, After) ->
    maps:map(fun(K, V) -> V - maps:get(K, Before, 0) end, After).

received(Nodes) ->
    Info = maps:get(nodes, convoy:info()),
    maps:from_list([{N, maps:get(received, maps:get(N, Info, #{}), 0)} || N <- Nodes]).

node_stats(Info, Node) ->
    maps:get(Node, maps:get(nodes, Info)).

ctx(Config) ->
    Sink = ?config(sink, Config),
    Sink ! {'$fuzz_q', alias, self()},
    Alias = receive {'$fuzz_alias', Al} -> Al after 5000 -> ct:fail(no_alias) end,
    Nobody = [list_to_atom("convoy_fuzz_nobody_" ++ integer_to_list(I)) || I <- lists:seq(1, 20)],
    Seed = ?config(seed, Config),
    {Dead, Mon} = spawn_monitor(fun() -> ok end),
    receive {'DOWN', Mon, process, Dead, _} -> ok end,
    Ctx = #{ct => node(), dead => Dead, local_ref => make_ref(), a => ?config(a, Config), b => ?config(b, Config),
      connected => lists:sort(nodes(connected)), sink => Sink, sink_name => ?SINK,
      alias => Alias, nobody => Nobody,
      ghosts => ['ghost@nohost', 'convoy_ghost@127.0.0.1'],
      peers_a => rpc_whereis(?config(a, Config), convoy_peers),
      peers_b => rpc_whereis(?config(b, Config), convoy_peers),
      seed => Seed},
    %% No generated atom but the sink's names a process here.
    ?assertEqual([?SINK], [N || N <- atoms(Ctx), whereis(N) =/= undefined]),
    Ctx.

rpc_whereis(Node, Name) ->
    erpc:call(Node, erlang, whereis, [Name]).

await_route(Node, Kind) ->
    convoy_ct_peers:await_route(Node, Kind).

await_remote_route(Peer, Node, Kind) ->
    convoy_ct_peers:await(
      fun() -> convoy_ct_peers:route_kind(peer:call(Peer, convoy_peers, route, [Node])) end,
      fun(R) -> R =:= Kind end, 10000).

%%--------------------------------------------------------------------
%% Counting processes

%% counter: counts every message that is not a query; answers queries about it.
counter() ->
    counter(0, alias(), []).

counter(N, Alias, Waiters) ->
    receive
        {'$fuzz_q', alias, From} ->
            From ! {'$fuzz_alias', Alias},
            counter(N, Alias, Waiters);
        {'$fuzz_q', value, From} ->
            From ! {'$fuzz_value', self(), N},
            counter(N, Alias, Waiters);
        {'$fuzz_q', await, Target, From} ->
            counter(N, Alias, answer(N, [{Target, From} | Waiters]));
        _ ->
            counter(N + 1, Alias, answer(N + 1, Waiters))
    end.

answer(N, Waiters) ->
    {Done, Left} = lists:partition(fun({T, _}) -> N >= T end, Waiters),
    [From ! {'$fuzz_value', self(), N} || {_, From} <- Done],
    Left.

counter_value(C) ->
    C ! {'$fuzz_q', value, self()},
    receive {'$fuzz_value', C, N} -> N after 10000 -> ct:fail({no_answer, C}) end.

%% The count once it reaches Target (or fail after 20 s).
await_counter(C, Target) ->
    C ! {'$fuzz_q', await, Target, self()},
    receive {'$fuzz_value', C, N} -> N after 20000 -> ct:fail({counter_short, C, Target}) end.

%% seq_sender: N messages through convoy, then flush; tells ReplyTo.
seq_sender(To, N, ReplyTo) ->
    [ok = convoy:send(To, {seq, self(), I}) || I <- lists:seq(1, N)],
    ok = convoy:flush(),
    case ReplyTo of
        none -> ok;
        _ -> ReplyTo ! {sent, self(), N}
    end,
    ok.

%%--------------------------------------------------------------------
%% Random terms (seeded rand)

rnd(N) -> rand:uniform(N).

pick(L) -> lists:nth(rnd(length(L)), L).

%% Atoms that may appear: protocol words, the sink's name, names nobody holds, node
%% names. Never a name of a process other than the sink, nor a message tag that a
%% process handles specially (system, 'EXIT', nodeup, '$gen_call', lane tags...).
atoms(#{sink_name := S, nobody := Nobody, ct := CT, a := A, b := B, ghosts := G}) ->
    ['$convoy', batch, hello, welcome, versions, node, peers, inboxes, request,
     '$convoy_barrier', '$convoy_mark', undefined, '', true, false, ok, error, S, CT, A, B
     | G ++ Nobody].

%% Pids and references: the sink (here), a dead one here, processes on A, and some
%% of nodes that are not connected.
pids(#{sink := Sink, dead := Dead, ghosts := [G | _]} = Ctx) ->
    [Sink, Dead, make_pid(G, 5)] ++ maps:get(local_pids, Ctx, []).

refs(#{alias := Alias, local_ref := LocalRef, ghosts := [G | _]}) ->
    [Alias, make_ref(), LocalRef, make_ref_on(G, 7)].

%% A pid or reference of a node that is not connected, as if it had arrived from
%% there. (This node's own pids and references are real ones: a made-up local pid
%% can be a corrupt term that makes the runtime drop the connection.)
make_pid(Node, Id) ->
    convoy_test_ids:pid(Node, Id, 7).

make_ref_on(Node, Creation) ->
    convoy_test_ids:ref(Node, 11, Creation).

leaf(Ctx) ->
    case rnd(13) of
        1 -> rnd(2001) - 1001;
        2 -> rnd(1 bsl 80) - (1 bsl 79);
        3 -> (rand:uniform() - 0.5) * 1.0e12;
        4 -> pick(atoms(Ctx));
        5 -> pick(atoms(Ctx));
        6 -> rand:bytes(rnd(24) - 1);
        7 -> <<(rnd(100)):7>>;
        8 -> pick(pids(Ctx));
        9 -> pick(refs(Ctx));
        10 -> [];
        11 -> "str";
        12 -> {};
        13 -> #{}
    end.

term(Ctx) -> term(Ctx, 4).

term(Ctx, D) when D =< 0 -> leaf(Ctx);
term(Ctx, D) ->
    case rnd(12) of
        N when N =< 4 -> leaf(Ctx);
        5 -> [term(Ctx, D - 1) || _ <- lists:seq(1, rnd(5) - 1)];
        6 -> improper([term(Ctx, D - 1) || _ <- lists:seq(1, rnd(3))], term(Ctx, D - 1));
        7 -> list_to_tuple([term(Ctx, D - 1) || _ <- lists:seq(1, rnd(5) - 1)]);
        8 -> maps:from_list([{term(Ctx, D - 1), term(Ctx, D - 1)} || _ <- lists:seq(1, rnd(4) - 1)]);
        9 -> {pick(atoms(Ctx)), term(Ctx, D - 1), term(Ctx, D - 1)};
        10 -> {term(Ctx, D - 1), term(Ctx, D - 1)};
        11 -> {'$convoy', term(Ctx, 1), pick([batch, hello, welcome, other]),
               term(Ctx, D - 1), term(Ctx, D - 1)};
        12 -> {'$convoy', term(Ctx, 1), pick([batch, hello, welcome, other]), term(Ctx, D - 1)}
    end.

%% A list with a non-list tail (the tail is never [] here).
improper(L, Tail) when Tail =:= []; is_list(Tail) -> improper(L, tail);
improper(L, Tail) -> lists:foldr(fun(E, Acc) -> [E | Acc] end, Tail, L).

lane_term(Ctx) -> term(Ctx).

%%--------------------------------------------------------------------
%% Near-valid input

vsn() ->
    case rnd(10) of
        N when N =< 7 -> 1;
        8 -> pick([0, 2, 3, 99, -1, 1 bsl 70]);
        9 -> pick([x, 1.0, "1", [1], <<1>>]);
        10 -> 2
    end.

from(#{a := A, b := B, ct := CT, ghosts := G} = Ctx) ->
    case rnd(20) of
        N when N =< 9 -> A;
        N when N =< 11 -> B; % a connected node that did not send it: accepted
        N when N =< 15 -> pick(G);
        16 -> CT;
        17 -> pick(["a@b", 1, {A}, <<"n">>]);
        _ -> pick(atoms(Ctx))
    end.

dest(#{sink := Sink, sink_name := S, alias := Alias, nobody := Nobody} = Ctx) ->
    case rnd(20) of
        N when N =< 5 -> Sink;
        N when N =< 8 -> S;
        N when N =< 10 -> Alias;
        N when N =< 13 -> pick(Nobody);
        14 -> undefined;
        15 -> pick(pids(Ctx));
        16 -> pick(refs(Ctx));
        17 -> pick([1, "sink", <<"sink">>, {S, maps:get(ct, Ctx)}, 2.5, []]);
        _ -> leaf(Ctx)
    end.

reply_to(#{counter := C} = Ctx) ->
    case rnd(6) of
        N when N =< 3 -> C; % a counter on A counts the answers
        4 -> pick(refs(Ctx));
        5 -> make_pid(pick(maps:get(ghosts, Ctx)), 3);
        6 -> leaf(Ctx)
    end.

entry(Ctx) ->
    case rnd(20) of
        N when N =< 8 -> {dest(Ctx), term(Ctx, 2)};
        N when N =< 11 -> {[dest(Ctx) || _ <- lists:seq(1, rnd(4) - 1)], term(Ctx, 2)};
        12 -> {improper([dest(Ctx) || _ <- lists:seq(1, rnd(3))], dest(Ctx)), term(Ctx, 1)};
        N when N =< 15 -> {'$convoy_barrier', reply_to(Ctx), term(Ctx, 1)};
        16 -> {'$convoy_mark', make_ref(), maps:get(ct, Ctx)};
        17 -> pick([{}, {a, b, c}, {a}, {'$convoy_barrier', maps:get(counter, Ctx)}, 7]);
        N when N =< 20 -> term(Ctx, 2);
        _ -> publish_entry(Ctx)
    end.

%% A publish entry (protocol version 2): to the pg group the sink is a member of,
%% to another group, to scopes that do not run here, with a scope that is not an
%% atom, a batch as the message, or the wrong arity.
publish_entry(#{nobody := Nobody} = Ctx) ->
    Scope = pick([?PG_SCOPE, ?PG_SCOPE, ?PG_SCOPE, pick(Nobody), undefined, "pg", 1]),
    Group = pick([?PG_GROUP, ?PG_GROUP, other_group, term(Ctx, 1)]),
    Msg = case rnd(8) of
              1 -> {'$convoy', 1, batch, maps:get(a, Ctx), [{maps:get(sink, Ctx), loop}]};
              _ -> term(Ctx, 2)
          end,
    case rnd(10) of
        1 -> {'$convoy_publish', Scope, Group};
        _ -> {'$convoy_publish', Scope, Group, Msg}
    end.

entries(Ctx) ->
    Proper = [entry(Ctx) || _ <- lists:seq(1, rnd(8) - 1)],
    case rnd(10) of
        N when N =< 7 -> Proper;
        N when N =< 9 -> improper(Proper, leaf(Ctx));
        10 -> leaf(Ctx)
    end.

batch(Ctx) ->
    case rnd(20) of
        1 -> {'$convoy', vsn(), pick([hello, welcome, other, "batch"]), from(Ctx), entries(Ctx)};
        N when N =< 5 -> {'$convoy', vsn(), zbatch, from(Ctx), compressed(Ctx)};
        _ -> {'$convoy', vsn(), batch, from(Ctx), entries(Ctx)}
    end.

%% A compressed batch's payload (protocol version 4): entries (perhaps an
%% improper list, or not a list) compressed at some level, or something that
%% does not decode: random bytes, a cut zlib stream, a term that is not a binary.
compressed(Ctx) ->
    case rnd(10) of
        N when N =< 6 -> term_to_binary(entries(Ctx), [{compressed, rnd(9)}]);
        7 -> rand:bytes(rnd(40) - 1);
        8 -> Z = term_to_binary(entries(Ctx), [{compressed, 9}]),
             binary:part(Z, 0, byte_size(Z) div 2);
        9 -> term_to_binary(term(Ctx, 2), [compressed]);
        10 -> term(Ctx, 1)
    end.

hello_info(#{a := A, b := B, ct := CT, ghosts := G, peers_a := PA} = Ctx) ->
    Node = pick([A, A, B, CT | G]),
    Full = #{versions => pick([[1], [1, 2], [2], [7, 8], [], [0], [1 | 2], x, [1.0], [-1, 1]]),
             node => Node,
             peers => pick([PA, make_pid(Node, 77), make_pid(pick(G), 1), self(), x]),
             inboxes => pick([1, 2, 1024, 0, 1025, -1, x, 3.0]),
             %% a reference of A (where this runs), of this node, of a ghost, or not one
             request => pick(refs(Ctx) ++ [x, self()])},
    Info = maps:without([K || K <- maps:keys(Full), rnd(6) =:= 1], Full),
    case rnd(8) of
        1 -> Info#{term(Ctx, 1) => term(Ctx, 1)};
        2 -> term(Ctx, 2);
        _ -> Info
    end.

hello(Ctx) ->
    {'$convoy', vsn(), pick([hello, hello, welcome, other]), hello_info(Ctx)}.

%% A well-formed hello from a node that is not connected.
ghost_hello(#{ghosts := G}) ->
    Node = pick(G),
    {'$convoy', 1, pick([hello, welcome]),
     #{versions => [1], node => Node, peers => make_pid(Node, 9), inboxes => 1}}.

%% Messages the runtime sends these processes, about nodes that are not connected
%% or monitors they do not hold: node messages are handled, not counted as rejected
%% (they may be late real ones); a DOWN convoy_peers does not hold is counted.
internal(peers, #{ghosts := G}) ->
    pick([{nodedown, pick(G), []}, {nodeup, pick(G), []},
          {'DOWN', make_ref(), process, self(), normal}]);
internal(inbox, #{ghosts := G}) ->
    pick([{nodedown, pick(G)}, {nodeup, pick(G)}]).

near_valid(Ctx) ->
    case rnd(50) of
        N when N =< 30 -> batch(Ctx);
        N when N =< 40 -> hello(Ctx);
        N when N =< 49 -> term(Ctx);
        50 -> internal(inbox, Ctx)
    end.

%%--------------------------------------------------------------------
%% The oracle: what convoy_wire's protocol description says an input deserves.

decode({'$convoy', V, batch, From, Entries}) when is_integer(V) ->
    if V =/= 1 -> {error, bad_version}; % a batch's envelope is version 1's in every version
       is_atom(From), is_list(Entries) -> {batch, From, Entries};
       true -> {error, malformed_batch}
    end;
decode({'$convoy', V, zbatch, From, Payload}) when is_integer(V) ->
    if V =/= 1 -> {error, bad_version};
       is_atom(From) -> {zbatch, From, Payload};
       true -> {error, malformed_batch}
    end;
decode({'$convoy', V, Kind, Info}) when Kind =:= hello; Kind =:= welcome ->
    case is_integer(V) andalso good_hello(Info) andalso good_request(Kind, Info) of
        true -> {Kind, Info};
        false -> {error, bad_hello}
    end;
decode({'$convoy', _, _, _, _}) -> {error, malformed_batch};
decode({'$convoy', _, _, _}) -> {error, bad_hello};
decode(_) -> {error, unknown_message}.

good_hello(#{versions := Vs, node := N, peers := P, inboxes := I}) ->
    proper(Vs) andalso Vs =/= [] andalso lists:all(fun(V) -> is_integer(V) andalso V > 0 end, Vs)
        andalso is_atom(N) andalso is_pid(P) andalso node(P) =:= N
        andalso is_integer(I) andalso I >= 1 andalso I =< 1024;
good_hello(_) -> false.

%% The optional request: in a hello, a reference of the node it claims; in a
%% welcome, a reference.
good_request(hello, #{request := R, node := N}) -> is_reference(R) andalso node(R) =:= N;
good_request(welcome, #{request := R}) -> is_reference(R);
good_request(_, _) -> true.

proper([]) -> true;
proper([_ | T]) -> proper(T);
proper(_) -> false.

%% An inbox decodes a compressed batch's payload, trusted as distribution is:
%% the proper list of entries it encodes, or nothing at all.
inflate(Payload) when is_binary(Payload) ->
    try binary_to_term(Payload) of
        Entries -> case proper(Entries) of
                       true -> {ok, Entries};
                       false -> error
                   end
    catch
        error:badarg -> error
    end;
inflate(_) ->
    error.

%% Effects of one input to an inbox, added to Acc.
inbox_effect({NodeUpDown, _}, _Ctx, Acc) when NodeUpDown =:= nodeup; NodeUpDown =:= nodedown ->
    Acc;
inbox_effect(Term, Ctx, Acc) ->
    case decode(Term) of
        {batch, From, Entries} ->
            batch_effect(From, Entries, Ctx, Acc);
        {zbatch, From, Payload} ->
            %% decoded first, then taken as the batch it encodes
            case inflate(Payload) of
                {ok, Entries} -> batch_effect(From, Entries, Ctx, Acc);
                error -> reject(bad_compressed, Acc)
            end;
        {error, Kind} -> reject(Kind, Acc);
        {Hello, _} when Hello =:= hello; Hello =:= welcome -> reject(unknown_message, Acc)
    end.

batch_effect(From, Entries, Ctx = #{connected := Connected}, Acc) ->
    case lists:member(From, Connected) of
        true -> entries_effect(Entries, From, Ctx, Acc);
        false -> reject(unknown_node, Acc)
    end.

entries_effect([], _From, _Ctx, Acc) ->
    Acc;
entries_effect([E | Rest], From, Ctx, Acc) ->
    entries_effect(Rest, From, Ctx, entry_effect(E, From, Ctx, Acc));
entries_effect(_Tail, _From, _Ctx, Acc) ->
    reject(malformed_batch, Acc).

%% A batch (plain or compressed) multicast inside a batch is never delivered (an
%% inbox would feed itself); in a plain entry it is a message like any other.
entry_effect({Tos, {'$convoy', _, Batch, _, _}}, _From, _Ctx, Acc)
  when is_list(Tos), Batch =:= batch orelse Batch =:= zbatch ->
    reject(bad_entry, Acc);
%% A barrier is answered only to a process of the node the batch says it is from.
entry_effect({'$convoy_barrier', R, _}, From, #{counter := C, sink := S, alias := Al}, Acc)
  when is_pid(R); is_reference(R) ->
    if node(R) =/= From -> reject(bad_entry, Acc);
       R =:= C -> bump(barriers, 1, Acc);
       R =:= S; R =:= Al -> bump(sink, 1, Acc);
       true -> Acc
    end;
%% (Generated multicasts have at most 3 destinations and small terms: never
%% over convoy_wire's limits, so never too_costly.)
%% A publish entry goes to the members of the group on this node at delivery time
%% (the sink is the only member of ?PG_GROUP, and other groups have none); a scope
%% that does not run here is undeliverable; a scope that is not an atom is a bad
%% entry.
entry_effect({'$convoy_publish', _Scope, _Group, {'$convoy', _, Batch, _, _}}, _From, _Ctx, Acc)
  when Batch =:= batch; Batch =:= zbatch ->
    reject(bad_entry, Acc);
entry_effect({'$convoy_publish', ?PG_SCOPE, Group, _Msg}, From, _Ctx, Acc) ->
    case Group of
        ?PG_GROUP -> bump(sink, 1, received(From, Acc));
        _ -> received(From, Acc)
    end;
entry_effect({'$convoy_publish', Scope, _Group, _Msg}, _From, _Ctx, Acc) when is_atom(Scope) ->
    reject(undeliverable, Acc);
entry_effect({Tos, _Msg}, From, Ctx, Acc) when is_list(Tos) ->
    case proper(Tos) andalso lists:all(fun(D) -> local(D, Ctx) end, Tos) of
        true -> lists:foldl(fun(D, A) -> delivered(D, Ctx, A) end, received(From, Acc), Tos);
        false -> reject(bad_entry, Acc)
    end;
entry_effect({To, _Msg}, From, Ctx, Acc) ->
    case local(To, Ctx) of
        true -> delivered(To, Ctx, received(From, Acc));
        false -> reject(bad_entry, Acc)
    end;
entry_effect(_, _From, _Ctx, Acc) ->
    reject(bad_entry, Acc).

local(D, #{ct := CT}) when is_pid(D); is_reference(D) -> node(D) =:= CT;
local(undefined, _) -> false;
local(D, _) -> is_atom(D).

%% Only the sink's name is registered among the generated atoms.
delivered(D, #{sink := Sink, sink_name := Name, alias := Alias}, Acc) ->
    if D =:= Sink; D =:= Name; D =:= Alias -> bump(sink, 1, Acc);
       is_atom(D) -> reject(undeliverable, Acc);
       true -> Acc % a dead pid or a plain reference here: dropped, like `!'
    end.

received(From, Acc = #{received := R}) ->
    Acc#{received := maps:update_with(From, fun(N) -> N + 1 end, R)}.

reject(Kind, Acc = #{rejected := R}) ->
    Acc#{rejected := maps:update_with(Kind, fun(N) -> N + 1 end, R)}.

bump(Key, N, Acc) -> maps:update_with(Key, fun(V) -> V + N end, Acc).

%% Effects of one message to convoy_peers. A hello only makes this node ask the
%% node it claims (whose genuine answer changes nothing), a welcome is learnt from
%% only when it answers this node's request (these never do), and the runtime's
%% node messages are acted on only when they agree with the node's state; a DOWN
%% for a monitor convoy_peers does not hold cannot be real.
peers_effect({NodeUpDown, _, _}, _Ctx, Acc) when NodeUpDown =:= nodeup; NodeUpDown =:= nodedown ->
    Acc;
peers_effect(Term, #{connected := Connected}, Acc) ->
    case decode(Term) of
        {batch, _, _} -> reject(unknown_message, Acc);
        {zbatch, _, _} -> reject(unknown_message, Acc);
        {error, Kind} -> reject(Kind, Acc);
        {welcome, _} -> reject(unsolicited, Acc);
        {hello, #{node := N}} ->
            case lists:member(N, Connected) of
                false -> reject(unknown_node, Acc);
                true -> Acc
            end
    end.

%%--------------------------------------------------------------------
%% Run on peer A

send_then_barrier(To, Msg) ->
    To ! Msg,
    _ = (catch sys:get_state(To, 10000)),
    ok.

start_fuzz(Ctx = #{seed := Seed}) ->
    rand:seed(exsss, Seed),
    Ctx#{counter => spawn(?MODULE, counter, []),
         local_pids => [self()]}.

empty_effects(#{a := A, b := B}) ->
    #{rejected => zero(), received => #{A => 0, B => 0}, sink => 0, barriers => 0}.

fuzz_inboxes_remote(Ctx0, N) ->
    Ctx = #{ct := CT} = start_fuzz(Ctx0),
    Inboxes = [{convoy_inbox_1, CT}, {convoy_inbox_2, CT}],
    Acc = lists:foldl(
            fun(I, Acc0) ->
                    Term = case I rem 3 of
                               0 -> term(Ctx);
                               _ -> near_valid(Ctx)
                           end,
                    pick(Inboxes) ! Term,
                    inbox_effect(Term, Ctx, Acc0)
            end, empty_effects(Ctx), lists:seq(1, N)),
    %% Barrier: each inbox has handled everything this process sent it.
    [_ = sys:get_state(Inbox, 30000) || Inbox <- Inboxes],
    #{barriers := Barriers} = Acc,
    Got = await_counter(maps:get(counter, Ctx), Barriers),
    Got =:= Barriers orelse error({barrier_answers, Got, Barriers}),
    {N, maps:remove(barriers, Acc)}.

fuzz_peers_remote(Ctx0, N) ->
    Ctx = #{ct := CT} = start_fuzz(Ctx0),
    Peers = {convoy_peers, CT},
    Acc1 = fuzz_peers_loop(N, Peers, Ctx, empty_effects(Ctx)),
    %% gen_server calls and casts with random terms
    Acc2 = lists:foldl(
             fun(_, Acc) ->
                     {error, unknown_call} = gen_server:call(Peers, term(Ctx), 10000),
                     ok = gen_server:cast(Peers, term(Ctx)),
                     reject(unknown_message, reject(unknown_message, Acc))
             end, Acc1, lists:seq(1, ?PEERS_CALLS)),
    _ = sys:get_state(Peers, 30000),
    {N + 2 * ?PEERS_CALLS, Acc2}.

fuzz_peers_loop(0, _Peers, _Ctx, Acc) ->
    Acc;
fuzz_peers_loop(N, Peers, Ctx, Acc) ->
    Term = case rnd(20) of
               R when R =< 6 -> term(Ctx);
               R when R =< 12 -> hello(Ctx);
               R when R =< 15 -> ghost_hello(Ctx);
               R when R =< 19 -> batch(Ctx);
               20 -> internal(peers, Ctx)
           end,
    Peers ! Term,
    fuzz_peers_loop(N - 1, Peers, Ctx, peers_effect(Term, Ctx, Acc)).
