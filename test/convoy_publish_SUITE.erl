%% convoy:publish/2,3 with peer nodes: one copy per member on every node, order
%% with the sender's other convoy traffic, members joining and leaving under
%% traffic, the fallbacks (a version-1 peer, a node without convoy, convoy not
%% running here), forged and malformed publish entries, and a large group that
%% must not hold an inbox.
-module(convoy_publish_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([one_copy_per_member/1, default_scope/1, order_with_sends/1,
         members_join_and_leave/1, version1_peer_gets_multicast/1,
         node_without_convoy/1, not_running_here/1, bad_scope_badarg/1,
         forged_publish_entries/1, huge_group_does_not_hold_inbox/1,
         run_of_publishes_member_by_member/1, run_of_multicasts_dest_by_dest/1]).
%% Run on peer nodes.
-export([member/0, start_scope/1, fake_scope/1, trace_sends/1,
         huge_group/3, huge_member/2]).

suite() ->
    [{timetrap, {seconds, 120}}].

all() ->
    [one_copy_per_member, default_scope, order_with_sends, members_join_and_leave,
     version1_peer_gets_multicast, node_without_convoy, not_running_here,
     bad_scope_badarg, forged_publish_entries, huge_group_does_not_hold_inbox,
     run_of_publishes_member_by_member, run_of_multicasts_dest_by_dest].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------
%% Helpers

start_convoy() ->
    {ok, _} = application:ensure_all_started(convoy),
    ok.

convoy_peer(Name) ->
    convoy_ct_peers:convoy_peer(?MODULE, Name, #{}).

%% A pg scope on Node (this node or a peer), not linked to the caller.
scope(Node, Scope) ->
    ok = erpc:call(Node, ?MODULE, start_scope, [Scope]).

-spec start_scope(atom()) -> ok.
start_scope(Scope) ->
    case pg:start(Scope) of
        {ok, _} -> ok;
        {error, {already_started, _}} -> ok
    end.

%% K members of Group on Node, joined there.
members(Node, Scope, Group, K) ->
    Pids = [spawn(Node, ?MODULE, member, []) || _ <- lists:seq(1, K)],
    ok = erpc:call(Node, pg, join, [Scope, Group, Pids]),
    Pids.

%% A member: records what it gets, in order.
-spec member() -> no_return().
member() -> member([]).

member(Acc) ->
    receive
        {'$get', From} ->
            From ! {'$got', self(), lists:reverse(Acc)},
            member(Acc);
        {'$leave', Scope, Group, From} ->
            ok = pg:leave(Scope, Group, self()),
            From ! {'$left', self()},
            member(Acc);
        stop ->
            ok;
        M ->
            member([M | Acc])
    end.

got(Pid) ->
    Pid ! {'$get', self()},
    receive {'$got', Pid, Msgs} -> Msgs after 10000 -> ct:fail({member_silent, Pid}) end.

%% Wait until this node sees N members of the group.
await_members(Scope, Group, N) ->
    convoy_ct_peers:await(fun() -> length(pg:get_members(Scope, Group)) end,
                          fun(L) -> L =:= N end, 10000).

%% Wait until every member has Expected.
await_got(Pids, Expected) ->
    [convoy_ct_peers:await(fun() -> got(P) end, fun(M) -> length(M) >= length(Expected) end,
                           20000) || P <- Pids],
    [?assertEqual({P, Expected}, {P, got(P)}) || P <- Pids],
    ok.

rejected(Peer) ->
    maps:get(rejected, peer:call(Peer, convoy, info, [])).

inbox(Peer) ->
    peer:call(Peer, erlang, whereis, [convoy_inbox_1]).

node_stats(Node) ->
    maps:get(Node, maps:get(nodes, convoy:info())).

%%--------------------------------------------------------------------
%% Cases

%% Members here and on two peers: each gets every message once, in order; one
%% entry per message per remote node.
one_copy_per_member(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_b)),
    {PeerC, C} = convoy_peer(?CT_PEER_NAME(pub_c)),
    [scope(N, pub_one) || N <- [node(), B, C]],
    Pids = lists:append([members(N, pub_one, g, 20) || N <- [node(), B, C]]),
    await_members(pub_one, g, 60),
    ok = convoy:flush(),
    Before = [sent(N) || N <- [B, C]],
    Msgs = [{pub, I} || I <- lists:seq(1, 50)],
    [ok = convoy:publish(pub_one, g, M) || M <- Msgs],
    ok = convoy:flush(),
    await_got(Pids, Msgs),
    %% One message per publish per node, not one per member.
    ?assertEqual([X + 50 || X <- Before], [sent(N) || N <- [B, C]]),
    [?assertMatch(#{bad_entry := 0, undeliverable := 0, too_costly := 0}, rejected(P))
     || P <- [PeerB, PeerC]].

%% Messages that left for Node, through the lane or by the sender itself.
sent(Node) ->
    maps:get(messages, node_stats(Node)).

%% publish/2 uses OTP's default scope, pg.
default_scope(_Config) ->
    start_convoy(),
    {_PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_default)),
    [scope(N, pg) || N <- [node(), B]],
    Pids = members(B, pg, dflt, 3) ++ members(node(), pg, dflt, 2),
    await_members(pg, dflt, 5),
    ok = convoy:publish(dflt, hello),
    await_got(Pids, [hello]).

%% One sender interleaving send/2 and publish/3 to a remote member, with small
%% and large messages: the member gets them in the order sent.
order_with_sends(_Config) ->
    start_convoy(),
    {_PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_order)),
    scope(node(), pub_order),
    scope(B, pub_order),
    [M1, M2] = members(B, pub_order, g, 2),
    await_members(pub_order, g, 2),
    Big = binary:copy(<<"x">>, 100000),
    Expected = lists:append(
                 [case I rem 7 of
                      0 -> [{s, I, Big}, {p, I}];
                      3 -> [{s, I}, {p, I, Big}];
                      _ -> [{s, I}, {p, I}]
                  end || I <- lists:seq(1, 2000)]),
    lists:foreach(fun(M) when element(1, M) =:= s -> ok = convoy:send(M1, M);
                     (M) -> ok = convoy:publish(pub_order, g, M)
                  end, Expected),
    await_got([M1], Expected),
    await_got([M2], [M || M <- Expected, element(1, M) =:= p]).

%% Members on a peer join and leave while a sender publishes: nothing crashes,
%% no member gets a message twice or out of order, and members that stayed get
%% everything.
members_join_and_leave(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_churn)),
    InboxB = inbox(PeerB),
    [scope(N, pub_churn) || N <- [node(), B]],
    Stayers = members(B, pub_churn, g, 5),
    await_members(pub_churn, g, 5),
    N = 3000,
    Self = self(),
    Sender = spawn_link(fun() ->
                                [ok = convoy:publish(pub_churn, g, {p, I}) || I <- lists:seq(1, N)],
                                ok = convoy:flush(),
                                Self ! {sent, self()}
                        end),
    Churners = churn(B, 30, []),
    receive {sent, Sender} -> ok after 60000 -> ct:fail(sender_stuck) end,
    Expected = [{p, I} || I <- lists:seq(1, N)],
    await_got(Stayers, Expected),
    [begin
         Got = got(P),
         %% a strictly increasing subsequence: no duplicate, no reordering
         Seqs = [I || {p, I} <- Got],
         ?assertEqual(length(Got), length(Seqs)),
         ?assertEqual(lists:usort(Seqs), Seqs)
     end || P <- Churners],
    ?assertEqual(InboxB, inbox(PeerB)),
    ?assertEqual(0, maps:get(bad_entry, rejected(PeerB))).

%% K rounds: a new member joins on Node, an older churner leaves.
churn(_Node, 0, Acc) ->
    Acc;
churn(Node, K, Acc) ->
    [P] = members(Node, pub_churn, g, 1),
    case Acc of
        [Old | _] when K rem 2 =:= 0 ->
            Old ! {'$leave', pub_churn, g, self()},
            receive {'$left', Old} -> ok after 5000 -> ct:fail(no_leave) end;
        _ ->
            ok
    end,
    receive after 5 -> ok end, % let the publisher run between churns
    churn(Node, K - 1, [P | Acc]).

%% A peer whose route says protocol version 1 gets multicast entries to the
%% members this node sees, never a publish entry. (The peer really reads this
%% release's version; its route is rewritten here as a version-1 peer's would be.)
version1_peer_gets_multicast(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_v1)),
    [scope(N, pub_v1) || N <- [node(), B]],
    Pids = members(B, pub_v1, g, 4),
    await_members(pub_v1, g, 4),
    {convoy, Vsn, Inboxes} = convoy_peers:route(B),
    ?assertEqual(convoy_wire:version(), Vsn),
    ok = convoy_ct_peers:route_as_version(B, 1),
    {convoy, 1, Inboxes} = convoy_peers:route(B),
    Tracer = peer:call(PeerB, convoy_ct_peers, trace_inbox, [convoy_inbox_1]),
    %% Several senders: some find the lane idle (batch of one from the sender),
    %% some queue behind others in the lane.
    Self = self(),
    Senders = [spawn_link(fun() ->
                                  [ok = convoy:publish(pub_v1, g, {v1, S, I})
                                   || I <- lists:seq(1, 20)],
                                  ok = convoy:flush(),
                                  Self ! {done, self()}
                          end) || S <- lists:seq(1, 4)],
    [receive {done, S} -> ok after 20000 -> ct:fail(sender_stuck) end || S <- Senders],
    [convoy_ct_peers:await(fun() -> length(got(P)) end, fun(L) -> L =:= 80 end, 20000)
     || P <- Pids],
    Entries = peer:call(PeerB, convoy_ct_peers, traced, [Tracer]),
    ?assert(length(Entries) >= 80),
    ?assertEqual([], [E || E <- Entries, element(1, E) =:= '$convoy_publish']),
    ?assertEqual([], [E || {Tos, _} = E <- Entries, lists:sort(Tos) =/= lists:sort(Pids)]),
    %% and to a node without members nothing at all
    ok = convoy:publish(pub_v1, nobody, x).

%% A node without convoy: its members get plain sends.
node_without_convoy(Config) ->
    start_convoy(),
    {_PeerB, B} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(pub_plain), #{}),
    convoy_ct_peers:await_route(B, plain),
    [scope(N, pub_plain) || N <- [node(), B]],
    Pids = members(B, pub_plain, g, 5),
    await_members(pub_plain, g, 5),
    Msgs = [{p, I} || I <- lists:seq(1, 200)],
    [ok = convoy:publish(pub_plain, g, M) || M <- Msgs],
    ok = convoy:flush(),
    await_got(Pids, Msgs),
    ?assertMatch(#{route := plain, dropped := 0}, node_stats(B)),
    _ = Config,
    ok.

%% convoy not running here: plain sends to every member.
not_running_here(_Config) ->
    {_PeerB, B} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(pub_off), #{}),
    [scope(N, pub_off) || N <- [node(), B]],
    Pids = members(B, pub_off, g, 3) ++ members(node(), pub_off, g, 2),
    await_members(pub_off, g, 5),
    false = maps:get(running, convoy:info()),
    Msgs = [{p, I} || I <- lists:seq(1, 100)],
    [ok = convoy:publish(pub_off, g, M) || M <- Msgs],
    await_got(Pids, Msgs),
    %% a group without members here or anywhere: nothing to send
    ok = convoy:publish(pub_off, nobody, x).

bad_scope_badarg(_Config) ->
    ?assertError(badarg, convoy:publish("pg", g, x)),
    ?assertError(badarg, convoy:publish({pg}, g, x)),
    %% a scope that does not run here: pg would answer no members, and nothing
    %% would be delivered; said, running or not
    ?assertError({badarg, {no_pg_scope, no_such_scope_here}},
                 convoy:publish(no_such_scope_here, g, x)),
    start_convoy(),
    ?assertError(badarg, convoy:publish(1, g, x)),
    ?assertError({badarg, {no_pg_scope, no_such_scope_here}},
                 convoy:publish(no_such_scope_here, g, x)).

%% Batches with publish entries sent straight to a peer's inbox: a scope that is
%% not an atom or a batch as the message is a bad entry, a scope that does not
%% run there (or a name that is not a pg scope) is undeliverable, and only local
%% pids in a scope's row are sent to; nothing of those
%% is delivered, the entries around them are, in order, and the inbox lives on.
forged_publish_entries(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_forged)),
    scope(B, pub_forged),
    [M] = members(B, pub_forged, g, 1),
    ok = peer:call(PeerB, ?MODULE, fake_scope, [M]),
    InboxB = inbox(PeerB),
    Before = rejected(PeerB),
    Batch = convoy_wire:batch(
              node(),
              [{M, first},
               {'$convoy_publish', "pub_forged", g, bad_scope},
               {'$convoy_publish', pub_forged, g, convoy_wire:batch(node(), [{M, loop}])},
               {'$convoy_publish', no_such_scope, g, nowhere},
               {'$convoy_publish', fake_scope, g, not_pg},
               {'$convoy_publish', fake_list_scope, g, not_pg_either},
               {'$convoy_publish', no_owner_scope, g, not_owned},
               {'$convoy_publish', pub_forged, g},
               {'$convoy_publish', pub_forged, g, valid},
               {'$convoy_publish', pub_forged, nobody, none},
               {M, last}]),
    {convoy_inbox_1, B} ! Batch,
    convoy_ct_peers:await(fun() -> got(M) end, fun(L) -> lists:member(last, L) end, 10000),
    %% fake_list_scope's row is read like pg's: its local pid gets the message
    %% once, the name in it nothing
    ?assertEqual([first, not_pg_either, valid, last], got(M)),
    After = rejected(PeerB),
    Delta = maps:filter(fun(_, V) -> V =/= 0 end,
                        maps:map(fun(K, V) -> V - maps:get(K, Before) end, After)),
    ?assertEqual(#{bad_entry => 3, undeliverable => 3}, Delta),
    ?assertEqual(InboxB, inbox(PeerB)).

%% On a peer: names that look like pg scopes (a registered process owning a
%% table of its name). fake_scope's row has no list of members; fake_list_scope's
%% lists the member among other terms: a name registered to the member itself,
%% which must not be sent to. no_owner_scope's table is not owned by the process
%% registered under its name.
-spec fake_scope(pid()) -> ok.
fake_scope(Member) ->
    true = register(fake_member_name, Member),
    [table_process(Name, Row, Owns)
     || {Name, Row, Owns} <- [{fake_scope, {g, [], not_a_list}, true},
                              {fake_list_scope, {g, [], [Member, fake_member_name, 7]}, true},
                              {no_owner_scope, {g, [], [Member]}, false}]],
    ok.

table_process(Name, Row, Owns) ->
    Self = self(),
    Owner = spawn(fun() ->
                          Name = ets:new(Name, [named_table, public]),
                          true = ets:insert(Name, Row),
                          Self ! {ready, self()},
                          receive stop -> ok end
                  end),
    receive {ready, Owner} -> ok end,
    case Owns of
        true -> true = register(Name, Owner);
        false -> spawn(fun() -> register(Name, self()), receive stop -> ok end end)
    end.

%% A group of 20,000 members on the peer and a message of about 500 words: the
%% inbox delivers the publish entry in slices (about 40 of them) and answers a
%% system message between two, with the entry not finished; a send after it in
%% the same batch reaches its member after the publish; every member gets one copy.
huge_group_does_not_hold_inbox(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_huge)),
    scope(B, pub_huge),
    {Counter, [Last | _]} = peer:call(PeerB, ?MODULE, huge_group, [pub_huge, g, 20000]),
    Msg = {big, lists:seq(1, 250)},
    {convoy_inbox_1, B} ! convoy_wire:batch(node(), [convoy_wire:publish(pub_huge, g, Msg),
                                                     {Last, after_publish}]),
    %% Sent from here after the batch, over the same connection: it reaches the
    %% inbox behind it (a call made on B could reach it before the batch, or
    %% after every slice).
    #{unfinished := Work} = sys:get_state({convoy_inbox_1, B}),
    ?assertMatch([_], maps:keys(Work)),
    [{_C, {members, Left, [Msg], _Each}, _Rest}] = maps:get(node(), Work),
    ?assert(length(Left) > 0),
    ?assert(length(Left) < 20000),
    Counter ! {'$count', self()},
    receive {'$count', 20000, Order} ->
            ?assertEqual([big, after_publish], Order)
    after 60000 -> ct:fail(huge_publish_incomplete)
    end,
    ?assertEqual(20000, length(peer:call(PeerB, pg, get_local_members, [pub_huge, g]))).

%% On a peer: N members of Group that count their copies with a shared counter;
%% returns the counter and the members (the last joined first). The counter
%% answers `{'$count', From}' once all N got the publish, with what the last
%% member got in order.
-spec huge_group(atom(), term(), pos_integer()) -> {pid(), [pid()]}.
huge_group(Scope, Group, N) ->
    Counter = spawn(fun() -> count_loop(N, 0, []) end),
    Pids = [spawn(?MODULE, huge_member, [Counter, []]) || _ <- lists:seq(1, N)],
    ok = pg:join(Scope, Group, Pids),
    {Counter, lists:reverse(Pids)}.

%% Hibernates after each message: 20,000 copies are not kept.
-spec huge_member(pid(), [atom()]) -> no_return().
huge_member(Counter, Acc) ->
    receive
        {big, _} ->
            Counter ! one,
            erlang:hibernate(?MODULE, huge_member, [Counter, [big | Acc]]);
        after_publish ->
            Counter ! {order, lists:reverse([after_publish | Acc])},
            erlang:hibernate(?MODULE, huge_member, [Counter, Acc])
    end.

count_loop(N, K, Order) ->
    receive
        one -> count_loop(N, K + 1, Order);
        {order, O} -> count_loop(N, K, O);
        {'$count', From} when K >= N, Order =/= [] ->
            From ! {'$count', K, Order}
    end.

%% Publish entries to one group, one after the other in a batch, are delivered
%% member by member (each member gets the run's messages back to back); an entry
%% of another kind, or to another group, ends the run, and order holds for every
%% member throughout.
run_of_publishes_member_by_member(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(pub_run)),
    scope(B, pub_run),
    [M1, M2, M3] = Ms = members(B, pub_run, g, 3),
    [Other] = members(B, pub_run, other, 1),
    Tracer = peer:call(PeerB, ?MODULE, trace_sends, [convoy_inbox_1]),
    P = fun(Group, Msg) -> convoy_wire:publish(pub_run, Group, Msg) end,
    {convoy_inbox_1, B} ! convoy_wire:batch(node(), [P(g, 1), P(g, 2), P(g, 3),
                                                     {M2, between},
                                                     P(g, 4), P(other, x), P(g, 5), P(g, 6),
                                                     {'$convoy_publish', "bad", g, 7},
                                                     P(g, 8)]),
    await_got([M1, M3], [1, 2, 3, 4, 5, 6, 8]),
    await_got([M2], [1, 2, 3, between, 4, 5, 6, 8]),
    await_got([Other], [x]),
    Sends = peer:call(PeerB, convoy_ct_peers, traced, [Tracer]),
    %% the runs [1, 2, 3] and [5, 6]: each member gets all of a run before the next
    %% member gets any of it
    Order = pg_order(PeerB, pub_run, g),
    Runs = fun(Run) -> [{To, X} || {To, X} <- Sends, lists:member(X, Run)] end,
    ?assertEqual([{To, X} || To <- Order, X <- [1, 2, 3]], Runs([1, 2, 3])),
    ?assertEqual([{To, X} || To <- Order, X <- [5, 6]], Runs([5, 6])),
    ?assertEqual(lists:sort(Ms), lists:sort(Order)),
    %% A member that joined twice gets each message twice, one after the other:
    %% no run then.
    ok = erpc:call(B, pg, join, [pub_run, dup, [M1, M1, M3]]),
    {convoy_inbox_1, B} ! convoy_wire:batch(node(), [P(dup, a), P(dup, b), P(dup, c)]),
    await_got([M1], [1, 2, 3, 4, 5, 6, 8, a, a, b, b, c, c]),
    await_got([M3], [1, 2, 3, 4, 5, 6, 8, a, b, c]).

pg_order(Peer, Scope, Group) ->
    peer:call(Peer, pg, get_local_members, [Scope, Group]).

%% On a peer: trace what a process sends; `convoy_ct_peers:traced/1' returns
%% `{To, Msg}' in order.
-spec trace_sends(atom()) -> pid().
trace_sends(Name) ->
    Tracer = spawn(fun() -> send_tracer([]) end),
    1 = erlang:trace(whereis(Name), true, [send, {tracer, Tracer}]),
    Tracer.

send_tracer(Acc) ->
    receive
        {trace, _, send, Msg, To} -> send_tracer([{To, Msg} | Acc]);
        {get, From} -> From ! {traced, lists:reverse(Acc)}
    end.

%% The same for multicast entries to the same distinct pids: destination by
%% destination; a list with a name (which may be one of its pids), or with a
%% destination twice, is not a run; a name nobody holds counts every message as
%% undeliverable.
run_of_multicasts_dest_by_dest(_Config) ->
    start_convoy(),
    {PeerB, B} = convoy_peer(?CT_PEER_NAME(multi_run)),
    [R1, R2, R3] = [spawn(B, ?MODULE, member, []) || _ <- [1, 2, 3]],
    true = erpc:call(B, erlang, register, [multi_run_name, R3]),
    Tos = [R1, R2, multi_run_name, multi_run_nobody],
    Before = rejected(PeerB),
    Tracer = peer:call(PeerB, ?MODULE, trace_sends, [convoy_inbox_1]),
    {convoy_inbox_1, B} ! convoy_wire:batch(node(), [{Tos, 1}, {Tos, 2}, {Tos, 3},
                                                     {[R1, R2], 4}, {[R2, R1], 5},
                                                     {Tos, 6},
                                                     {[R1, R1, R2], 7}, {[R1, R1, R2], 8},
                                                     {[R1, R2, R3], 9}, {[R1, R2, R3], 10}]),
    await_got([R1], [1, 2, 3, 4, 5, 6, 7, 7, 8, 8, 9, 10]),
    await_got([R2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    await_got([R3], [1, 2, 3, 6, 9, 10]),
    Sends = peer:call(PeerB, convoy_ct_peers, traced, [Tracer]),
    %% Names in the list: no run (a name may be a pid of the list), each entry to
    %% all its destinations in turn. (The trace shows the attempts to the name
    %% nobody holds too.)
    ?assertEqual([{To, X} || X <- [1, 2, 3], To <- Tos],
                 [{To, X} || {To, X} <- Sends, lists:member(X, [1, 2, 3])]),
    ?assertEqual([{R1, 7}, {R1, 7}, {R2, 7}, {R1, 8}, {R1, 8}, {R2, 8}],
                 [{To, X} || {To, X} <- Sends, lists:member(X, [7, 8])]),
    %% distinct pids: a run, destination by destination
    ?assertEqual([{To, X} || To <- [R1, R2, R3], X <- [9, 10]],
                 [{To, X} || {To, X} <- Sends, lists:member(X, [9, 10])]),
    %% multi_run_nobody: 1, 2, 3 and 6
    ?assertEqual(4, maps:get(undeliverable, rejected(PeerB)) - maps:get(undeliverable, Before)).
