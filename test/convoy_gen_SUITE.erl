%% convoy:cast/2 and convoy:call/2,3 against gen_servers on peer nodes: every
%% ServerRef form, every exit of call compared with what gen_server:call gives in
%% the same situation, no late reply left behind, order with convoy:send/2, many
%% concurrent callers, and a call that waits for room at a full node.
%%
%% The shared cases run in three situations (groups): the peer runs convoy
%% (`convoy_peer'), it does not (`plain_peer': convoy here sends plainly), and
%% convoy is not running here (`not_running').
-module(convoy_gen_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, groups/0, init_per_group/2, end_per_group/2,
         init_per_testcase/2, end_per_testcase/2]).
-export([cast_each_form/1, call_each_form/1, server_sees_gen_messages/1,
         noproc_each_form/1, nodedown/1, timeout_leaves_no_late_reply/1,
         default_timeout/1, server_stops_during_call/1, server_killed_mid_call/1,
         node_killed_mid_call/1, order_send_cast_call/1, concurrent_callers/1,
         malformed_like_gen_server/1, call_waits_for_room/1, local_forms/1,
         one_shared_monitor/1, server_dies_after_calls/1, calls_helper_killed_mid_call/1,
         idle_monitors_dropped/1, calls_helper_rejects_strays/1,
         busy_node_holds_no_other_calls/1, call_with_long_mailbox/1,
         name_changes_hands/1, calls_helper_rejects_stray_sweeps/1,
         calls_helper_killed_often/1, stalled_node_delays_no_down/1, calls_watcher_killed/1,
         call_to_stalled_node_times_out/1, own_watcher_ends_with_call/1]).

-define(SHARED, [cast_each_form, call_each_form, server_sees_gen_messages,
                 noproc_each_form, nodedown, timeout_leaves_no_late_reply,
                 server_stops_during_call, server_killed_mid_call,
                 node_killed_mid_call, order_send_cast_call, concurrent_callers,
                 call_with_long_mailbox, name_changes_hands]).

all() ->
    [{group, convoy_peer}, {group, plain_peer}, {group, not_running}, {group, local}].

groups() ->
    [{convoy_peer, [], ?SHARED ++ [default_timeout, malformed_like_gen_server,
                                   call_waits_for_room, one_shared_monitor,
                                   server_dies_after_calls, calls_helper_killed_mid_call,
                                   idle_monitors_dropped, calls_helper_rejects_strays,
                                   busy_node_holds_no_other_calls,
                                   stalled_node_delays_no_down, calls_watcher_killed,
                                   call_to_stalled_node_times_out, own_watcher_ends_with_call,
                                   calls_helper_killed_often]},
     {plain_peer, [], ?SHARED},
     {not_running, [], ?SHARED},
     {local, [], [local_forms, malformed_like_gen_server,
                  calls_helper_rejects_stray_sweeps]}].

init_per_group(Group, Config) ->
    [{situation, Group} | Config].

end_per_group(_Group, _Config) ->
    ok.

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    [application:unset_env(convoy, K) || K <- convoy_config:keys()],
    ok.

%%--------------------------------------------------------------------
%% Set-up

%% convoy here (unless not_running), a peer (running convoy unless plain_peer),
%% and a server there reachable by every ServerRef form.
setup(Config) ->
    setup(Config, #{}).

setup(Config, Settings) ->
    Situation = ?config(situation, Config),
    Situation =:= not_running orelse start_convoy(Settings),
    {Peer, Node} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(), #{}),
    case Situation of
        plain_peer ->
            convoy_ct_peers:await_route(Node, plain);
        convoy_peer ->
            ok = convoy_ct_peers:start_convoy(Peer, #{}),
            convoy_ct_peers:await_route(Node, convoy);
        _ ->
            ok = convoy_ct_peers:start_convoy(Peer, #{})
    end,
    Tag = erlang:unique_integer([positive]),
    Global = {gen_global, Tag},
    Via = {gen_via, Tag},
    {ok, Srv} = peer:call(Peer, convoy_ct_server, start, [{local, gen_srv}, self()]),
    yes = peer:call(Peer, global, register_name, [Global, Srv]),
    ok = global:sync(),
    yes = convoy_ct_server:register_name(Via, Srv),
    #{situation => Situation, peer => Peer, node => Node, server => Srv,
      forms => [Srv, {gen_srv, Node}, {global, Global}, {via, convoy_ct_server, Via}]}.

start_convoy(Settings) ->
    [ok = application:set_env(convoy, K, V) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = application:ensure_all_started(convoy),
    ok.

%% Messages convoy took for Node (by its lane, or sent by the sender itself).
handled(Node) ->
    case maps:get(Node, maps:get(nodes, convoy:info()), none) of
        none -> 0;
        #{accepted := A, direct := D} -> A + D
    end.

%% The requests went through convoy (at least N more handled for the node, on
%% the route the situation gives), or convoy is not running here.
went_through(#{situation := not_running}, _Before, _N) ->
    ?assertMatch(#{running := false}, convoy:info());
went_through(#{situation := S, node := Node}, Before, N) ->
    ?assert(handled(Node) - Before >= N, {handled, handled(Node), Before, N}),
    Route = maps:get(route, maps:get(Node, maps:get(nodes, convoy:info()))),
    ?assertEqual(case S of convoy_peer -> convoy; plain_peer -> plain end, Route).

before(#{situation := not_running}) -> 0;
before(#{node := Node}) -> handled(Node).

%% The exit reason of Fun, or what it returned.
exit_of(Fun) ->
    try Fun() of
        V -> {returned, V}
    catch
        exit:R -> R
    end.

%% The call both ways; asserts that convoy exits as gen_server does, and as
%% Expected; returns the reason.
same_exit(Expected, Call) ->
    Gen = exit_of(fun() -> Call(gen_server) end),
    Convoy = exit_of(fun() -> Call(convoy) end),
    ?assertEqual(Gen, Convoy),
    ?assertEqual(Expected, Convoy),
    Convoy.

%% A process on Node that is already dead.
dead_pid(Node) ->
    P = spawn(Node, fun() -> ok end),
    Mon = monitor(process, P),
    receive {'DOWN', Mon, process, P, _} -> P end.

%% Replies to the alias of a call, or DOWNs, that nobody waited for.
strays() ->
    {messages, Ms} = process_info(self(), messages),
    [M || M <- Ms, is_stray(M)].

is_stray({[alias | Ref], _}) when is_reference(Ref) -> true;
is_stray({'DOWN', _, process, _, _}) -> true;
is_stray({{'$convoy_server_down', _}, _, process, _, _}) -> true;
is_stray({{'$convoy_calls_gone', _}, _, process, _, _}) -> true;
is_stray({'$convoy_call_down', _, _}) -> true;
is_stray({'$convoy_call_watching', _}) -> true;
is_stray({Ref, _}) when is_reference(Ref) -> true;
is_stray(_) -> false.

%% Run Fun in a new process; returns its exit reason (or what it returned).
in_process(Fun) ->
    Self = self(),
    {Pid, Mon} = spawn_monitor(fun() -> Self ! {result, self(), exit_of(Fun)} end),
    {Pid, Mon}.

result_of({Pid, Mon}) ->
    receive {result, Pid, R} -> demonitor(Mon, [flush]), R
    after 30000 -> ct:fail({no_result, Pid})
    end.

%%--------------------------------------------------------------------
%% Shared cases

%% One cast per form; all arrive, as `{'$gen_cast', Req}' handled by handle_cast,
%% in order, through convoy.
cast_each_form(Config) ->
    S = #{server := Srv, forms := Forms} = setup(Config),
    B = before(S),
    Casts = [{hello, I} || I <- lists:seq(1, length(Forms))],
    [ok = convoy:cast(F, C) || {F, C} <- lists:zip(Forms, Casts)],
    ?assertEqual([{cast, C} || C <- Casts], convoy:call(Srv, log)),
    went_through(S, B, length(Casts) + 1).

call_each_form(Config) ->
    S = #{forms := Forms} = setup(Config),
    B = before(S),
    [begin
         ?assertEqual({F, 2}, convoy:call(F, {echo, {F, 2}})),
         ?assertEqual({F, 3}, convoy:call(F, {echo, {F, 3}}, 5000)),
         ?assertEqual({F, inf}, convoy:call(F, {echo, {F, inf}}, infinity)),
         ?assertEqual(gen_server:call(F, {echo, x}), convoy:call(F, {echo, x}))
     end || F <- Forms],
    ?assertEqual([], strays()),
    went_through(S, B, 4 * length(Forms)).

%% A bare process sees exactly what gen_server:cast and gen_server:call send, and
%% gen_server:reply/2 answers the call.
server_sees_gen_messages(Config) ->
    #{node := Node} = setup(Config),
    Self = self(),
    P = spawn(Node, fun Loop() ->
                            receive
                                {'$gen_call', From, R} = M ->
                                    Self ! {got, M},
                                    gen_server:reply(From, {re, R});
                                M ->
                                    Self ! {got, M}
                            end,
                            Loop()
                    end),
    ok = convoy:cast(P, c1),
    receive {got, M1} -> ?assertEqual({'$gen_cast', c1}, M1) after 5000 -> ct:fail(no_cast) end,
    ?assertEqual({re, r1}, convoy:call(P, r1)),
    receive
        {got, M2} ->
            ?assertMatch({'$gen_call', {Self, [alias | Ref]}, r1} when is_reference(Ref), M2)
    after 5000 -> ct:fail(no_call)
    end,
    exit(P, kill),
    ?assertEqual([], strays()).

%% noproc for each form, call/2 and call/3; casts to nobody are ok.
noproc_each_form(Config) ->
    #{node := Node} = setup(Config),
    Refs = [dead_pid(Node), {nosuch, Node}, {global, nosuch_global},
            {via, convoy_ct_server, nosuch_via}, nosuch_local],
    [begin
         same_exit({noproc, {gen_server, call, [R, x]}}, fun(M) -> M:call(R, x) end),
         same_exit({noproc, {gen_server, call, [R, x, 2000]}}, fun(M) -> M:call(R, x, 2000) end),
         ?assertEqual(ok, convoy:cast(R, x))
     end || R <- Refs],
    ?assertEqual([], strays()).

%% A node that does not exist, and a pid of a node that stopped.
nodedown(Config) ->
    #{peer := Peer, node := Node, server := Srv} = setup(Config),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Nowhere = list_to_atom("convoy_gen_nowhere@" ++ Host),
    R = {srv, Nowhere},
    same_exit({{nodedown, Nowhere}, {gen_server, call, [R, x, 3000]}},
              fun(M) -> M:call(R, x, 3000) end),
    ?assertEqual(ok, convoy:cast(R, x)),
    peer:stop(Peer),
    convoy_ct_peers:await(fun() -> lists:member(Node, nodes()) end, fun(Up) -> not Up end,
                          10000),
    same_exit({{nodedown, Node}, {gen_server, call, [Srv, x, 3000]}},
              fun(M) -> M:call(Srv, x, 3000) end),
    ?assertEqual(ok, convoy:cast(Srv, x)),
    ?assertEqual([], strays()).

%% A reply that comes after the timeout is dropped, not left in the mailbox.
timeout_leaves_no_late_reply(Config) ->
    #{server := Srv} = setup(Config),
    Req = {late, 300},
    same_exit({timeout, {gen_server, call, [Srv, Req, 50]}},
              fun(M) -> M:call(Srv, Req, 50) end),
    %% The server replied to both calls (each reply before its `replied', from
    %% the same process): whatever would be left is here now.
    [receive {replied, Srv} -> ok after 10000 -> ct:fail(no_late_reply) end
     || _ <- [gen, convoy]],
    ?assertEqual([], strays()),
    %% The server is fine and the next call gets its own answer.
    ?assertEqual(after_timeout, convoy:call(Srv, {echo, after_timeout})).

%% A caller with a long queue of other messages, look-alikes of a call's
%% answers among them (other aliases, other monitors' `DOWN' tags): every call
%% gets its own answer, and the queue is left as it was, in order. (convoy's
%% receive skips what was queued before the call, as gen_server:call's does;
%% this checks that nothing of it is taken or lost.)
call_with_long_mailbox(Config) ->
    #{server := Srv} = setup(Config),
    Other = erlang:alias(),
    Queued = lists:append([[{n, I}, {[alias | Other], I}, {'$convoy_call_down', Other, I},
                            {'$convoy_call_watching', Other},
                            {{'$convoy_server_down', Other}, make_ref(), process, self(), I},
                            {{'$convoy_calls_gone', Other}, make_ref(), process, self(), I}]
                           || I <- lists:seq(1, 4000)]),
    [self() ! M || M <- Queued],
    [?assertEqual({echo, I}, convoy:call(Ref, {echo, {echo, I}}))
     || Ref <- [Srv, {gen_srv, node(Srv)}], I <- lists:seq(1, 50)],
    ?assertEqual(Queued, [receive M -> M after 0 -> missing end || _ <- Queued]),
    ?assertEqual([], strays()),
    true = erlang:unalias(Other).

%% call/2's 5 s, with call/2's Args.
default_timeout(Config) ->
    #{server := Srv} = setup(Config),
    Req = {late, 6000},
    Callers = [in_process(fun() -> M:call(Srv, Req) end) || M <- [gen_server, convoy]],
    [Gen, Convoy] = [result_of(C) || C <- Callers],
    ?assertEqual({timeout, {gen_server, call, [Srv, Req]}}, Gen),
    ?assertEqual(Gen, Convoy).

%% The server stops while handling the call: the caller exits with its reason.
server_stops_during_call(Config) ->
    #{peer := Peer} = setup(Config),
    [begin
         [{ok, S1}, {ok, S2}] = [peer:call(Peer, convoy_ct_server, start, [self()])
                                 || _ <- [1, 2]],
         Req = {stop, Reason},
         ?assertEqual({Reason, {gen_server, call, [S1, Req, 5000]}},
                      exit_of(fun() -> gen_server:call(S1, Req, 5000) end)),
         ?assertEqual({Reason, {gen_server, call, [S2, Req, 5000]}},
                      exit_of(fun() -> convoy:call(S2, Req, 5000) end))
     end || Reason <- [normal, shutdown, {shutdown, why}, boom]],
    ?assertEqual([], strays()).

%% The server is killed while it holds the call.
server_killed_mid_call(Config) ->
    #{peer := Peer} = setup(Config),
    [{ok, S1}, {ok, S2}] = [peer:call(Peer, convoy_ct_server, start, [self()]) || _ <- [1, 2]],
    Callers = [in_process(fun() -> M:call(S, hold, infinity) end)
               || {M, S} <- [{gen_server, S1}, {convoy, S2}]],
    [receive {holding, S} -> exit(S, kill) after 10000 -> ct:fail({not_held, S}) end
     || S <- [S1, S2]],
    [Gen, Convoy] = [result_of(C) || C <- Callers],
    ?assertEqual({killed, {gen_server, call, [S1, hold, infinity]}}, Gen),
    ?assertEqual({killed, {gen_server, call, [S2, hold, infinity]}}, Convoy).

%% `{Name, Node}' whose holder changed: the first holder, still alive, gave the
%% name up and a new server took it. A call goes to the holder of the name at
%% the time of the call and exits as gen_server:call does: `killed' when the new
%% holder is killed mid-call, `noproc' once nobody holds the name.
name_changes_hands(Config) ->
    #{peer := Peer, node := Node, server := First} = setup(Config),
    Name = {gen_srv, Node},
    ?assertEqual(ok, convoy:call(Name, {echo, ok})),
    ok = calls_barrier(),
    true = peer:call(Peer, erlang, unregister, [gen_srv]),
    {ok, Second} = peer:call(Peer, convoy_ct_server, start, [{local, gen_srv}, self()]),
    Callers = [in_process(fun() -> M:call(Name, hold, 5000) end) || M <- [gen_server, convoy]],
    [receive {holding, Second} -> ok after 10000 -> ct:fail(not_held) end || _ <- Callers],
    exit(Second, kill),
    [Gen, Convoy] = [result_of(C) || C <- Callers],
    ?assertEqual({killed, {gen_server, call, [Name, hold, 5000]}}, Gen),
    ?assertEqual(Gen, Convoy),
    same_exit({noproc, {gen_server, call, [Name, x, 2000]}},
              fun(M) -> M:call(Name, x, 2000) end),
    ?assertEqual(alive, convoy:call(First, {echo, alive})),
    ?assertEqual([], strays()).

%% What convoy_calls was asked before this (a cast) is done, if it runs.
calls_barrier() ->
    case whereis(convoy_calls) of
        undefined -> ok;
        Helper -> _ = sys:get_state(Helper), ok
    end.

%% Many concurrent callers of one server: one monitor of it from this node,
%% convoy_calls's watcher's, not one per call (gen_server:call's way: two
%% signals a call).
one_shared_monitor(Config) ->
    #{peer := Peer, server := Srv} = setup(Config),
    Callers = [in_process(fun() -> [I = convoy:call(Srv, {echo, I}) || I <- lists:seq(1, 200)], ok end)
               || _ <- lists:seq(1, 20)],
    [{returned, ok} = result_of(C) || C <- Callers],
    ?assert(ets:member(convoy_call_watched, Srv)),
    ?assert(shared_monitor(monitors_from_here(Peer, Srv))).

%% A first call monitors the server itself and has convoy_calls watch it: wait
%% until it does (later calls share its monitor).
await_watched(Srv) ->
    ok = gen_server:call(Srv, {echo, ok}),
    ok = convoy:call(Srv, {echo, ok}),
    convoy_ct_peers:await(fun() -> ets:member(convoy_call_watched, Srv) end,
                          fun(W) -> W end, 5000).

%% Monitors of Srv (on Peer) held by processes of this node, but global's (a
%% globally registered server is monitored by global_name_server).
monitors_from_here(Peer, Srv) ->
    {monitored_by, By} = peer:call(Peer, erlang, process_info, [Srv, monitored_by]),
    [P || P <- By, is_pid(P), node(P) =:= node(), P =/= whereis(global_name_server)].

%% The monitors are one, held by a watcher of convoy_calls (linked to it alone).
shared_monitor([W]) ->
    process_info(W, initial_call) =:= {initial_call, {convoy_calls, watcher, 2}}
        andalso process_info(W, links) =:= {links, [whereis(convoy_calls)]};
shared_monitor(_) ->
    false.

%% A server that dies after the calls are over: its DOWN goes to convoy_calls,
%% nothing reaches the callers.
server_dies_after_calls(Config) ->
    #{server := Srv} = setup(Config),
    [{echo, I} = convoy:call(Srv, {echo, {echo, I}}) || I <- lists:seq(1, 10)],
    await_watched(Srv),
    Mon = monitor(process, Srv),
    exit(Srv, kill),
    receive {'DOWN', Mon, process, Srv, killed} -> ok end,
    %% convoy_calls's DOWN may come a little after ours (a call made before it
    %% does exits `killed', as one made just before the death would).
    convoy_ct_peers:await(fun() -> ets:member(convoy_call_watched, Srv) end,
                          fun(W) -> not W end, 5000),
    ?assertEqual([], strays()),
    ?assertEqual({noproc, {gen_server, call, [Srv, x]}}, exit_of(fun() -> convoy:call(Srv, x) end)).

%% convoy_calls killed while calls wait: each caller watches its server itself
%% from then on (the server's exit reason reaches it, no hang; a reply still
%% comes, and that monitor leaves nothing behind), convoy_calls is restarted
%% alone (the lanes stay) and calls go on.
calls_helper_killed_mid_call(Config) ->
    #{peer := Peer} = setup(Config),
    [{ok, S}, {ok, Late}] = [peer:call(Peer, convoy_ct_server, start, [self()]) || _ <- [1, 2]],
    [await_watched(P) || P <- [S, Late]],
    Lanes = [P || #{pid := P} <- maps:get(lanes, convoy:info())],
    Self = self(),
    Held = in_process(fun() -> convoy:call(S, hold, infinity) end),
    Answered = in_process(fun() ->
                                  R = exit_of(fun() -> convoy:call(Late, {late, 1000}) end),
                                  Self ! {answered, self()},
                                  receive checked -> {R, strays()} end
                          end),
    receive {holding, S} -> ok after 10000 -> ct:fail(not_held) end,
    Helper = whereis(convoy_calls),
    exit(Helper, kill),
    convoy_ct_peers:await(fun() -> whereis(convoy_calls) end,
                          fun(P) -> is_pid(P) andalso P =/= Helper end, 10000),
    exit(S, boom),
    ?assertEqual({boom, {gen_server, call, [S, hold, infinity]}}, result_of(Held)),
    {AnsweredPid, _} = Answered,
    receive {answered, AnsweredPid} -> ok after 10000 -> ct:fail(not_answered) end,
    LateMon = monitor(process, Late),
    exit(Late, kill),
    receive {'DOWN', LateMon, process, Late, _} -> ok end,
    timer:sleep(200), % a DOWN to the caller, if any, has arrived
    AnsweredPid ! checked,
    ?assertEqual({returned, {{returned, late}, []}}, result_of(Answered)),
    ?assertEqual(Lanes, [P || #{pid := P} <- maps:get(lanes, convoy:info())]),
    {ok, S2} = peer:call(Peer, convoy_ct_server, start, [self()]),
    await_watched(S2),
    ?assertEqual(2, convoy:call(S2, {echo, 2})),
    ?assert(shared_monitor(monitors_from_here(Peer, S2))).

%% convoy_calls killed as soon as each new one is up, beyond its supervisor's
%% restart intensity: its supervisor gives up and nothing else of convoy is
%% restarted (lanes, peers, inboxes, control keep their pids), the application
%% runs, and calls go on, each monitoring its server itself, until convoy
%% restarts (which brings convoy_calls back).
calls_helper_killed_often(Config) ->
    #{peer := Peer, server := Srv, node := Node} = setup(Config),
    await_watched(Srv),
    Rest = convoy_pids(),
    Killed = kill_calls_helper(25, []),
    ?assert(length(Killed) > 10, {killed, length(Killed)}),
    ?assertEqual(Rest, convoy_pids()),
    ?assert(lists:keymember(convoy, 1, application:which_applications())),
    ?assertEqual(undefined, whereis(convoy_calls)),
    ?assertEqual(ok, convoy:call(Srv, {echo, ok})),
    ?assertEqual(ok, convoy:call({gen_srv, Node}, {echo, ok})),
    ?assertEqual(convoy, maps:get(route, maps:get(Node, maps:get(nodes, convoy:info())))),
    {ok, Held} = peer:call(Peer, convoy_ct_server, start, [self()]),
    Caller = in_process(fun() -> convoy:call(Held, hold, infinity) end),
    receive {holding, Held} -> exit(Held, kill) after 10000 -> ct:fail(not_held) end,
    ?assertEqual({killed, {gen_server, call, [Held, hold, infinity]}}, result_of(Caller)),
    ok = application:stop(convoy),
    start_convoy(#{}),
    ?assert(is_pid(whereis(convoy_calls))),
    ?assertEqual([], strays()).

%% The processes of convoy but convoy_calls and its supervisor.
convoy_pids() ->
    Named = [whereis(N) || N <- [convoy_sup, convoy_peers, convoy_inbox_sup,
                                 convoy_lane_sup, convoy_control]],
    Lanes = [P || #{pid := P} <- maps:get(lanes, convoy:info())],
    Inboxes = [P || {_, P, _, _} <- supervisor:which_children(convoy_inbox_sup)],
    {Named, Lanes, Inboxes}.

%% Kills each new convoy_calls as soon as it is up, N times or until its
%% supervisor is gone; returns the pids killed.
kill_calls_helper(0, Killed) ->
    Killed;
kill_calls_helper(N, Killed) ->
    IsNew = fun(P) -> is_pid(P) andalso not lists:member(P, Killed) end,
    {P, _} = convoy_ct_peers:await(
               fun() -> {whereis(convoy_calls), whereis(convoy_calls_sup)} end,
               fun({P1, Sup}) -> IsNew(P1) orelse Sup =:= undefined end, 10000),
    case IsNew(P) of
        true -> exit(P, kill), kill_calls_helper(N - 1, [P | Killed]);
        false -> Killed
    end.

%% A node stopped with its connection full holds nothing to do with other nodes:
%% convoy_calls, asked to watch a server there, goes on answering (its watcher
%% waits for the connection in its place), and calls to another node's servers,
%% watched or not yet, go on.
busy_node_holds_no_other_calls(Config) ->
    #{server := SrvC, peer := PeerC} = setup(Config),
    await_watched(SrvC),
    B = #{server := SrvB} = stalled_node(),
    try
        stall(B),
        HeldCall = in_process(fun() -> convoy:call(SrvB, {echo, b}, 60000) end),
        past_watch(HeldCall),
        Helper = whereis(convoy_calls),
        convoy_ct_peers:await(fun() -> suspended_watchers(Helper) end,
                              fun(Ws) -> Ws =/= [] end, 10000),
        _ = sys:get_state(Helper, 1000),
        {ok, SrvC2} = peer:call(PeerC, convoy_ct_server, start, [self()]),
        T0 = erlang:monotonic_time(millisecond),
        ?assertEqual(c, convoy:call(SrvC, {echo, c}, 5000)),
        ?assertEqual(c2, convoy:call(SrvC2, {echo, c2}, 5000)),
        ?assert(erlang:monotonic_time(millisecond) - T0 < 2000),
        resume(B),
        ?assertEqual({returned, b}, result_of(HeldCall))
    after
        resume(B)
    end,
    peer:stop(maps:get(peer, B)).

%% A server on a healthy node is killed mid-call while convoy_calls is asked to
%% watch a server on a node stopped with its connection full: the caller, which
%% relies on the shared watch, exits `killed' at once, Timeout `infinity'. (Were
%% convoy_calls to take that monitor itself, it would pass on nothing until the
%% stalled node drained.)
stalled_node_delays_no_down(Config) ->
    #{server := SrvC} = setup(Config),
    await_watched(SrvC),
    Caller = in_process(fun() -> convoy:call(SrvC, hold, infinity) end),
    receive {holding, SrvC} -> ok after 10000 -> ct:fail(not_held) end,
    %% It relies on the shared watch (a caller that does not leaves no entry).
    ?assertMatch([_], ets:match(convoy_call_waiters, {'_', SrvC, '_'})),
    B = #{server := SrvB} = stalled_node(),
    try
        stall(B),
        HeldCall = in_process(fun() -> convoy:call(SrvB, {echo, b}, 60000) end),
        past_watch(HeldCall),
        T0 = erlang:monotonic_time(millisecond),
        exit(SrvC, kill),
        R = result_within(Caller, 5000),
        T = erlang:monotonic_time(millisecond) - T0,
        ct:pal("killed mid-call, exit after ~b ms", [T]),
        ?assertEqual({killed, {gen_server, call, [SrvC, hold, infinity]}}, R),
        ?assert(T < 2000, {took, T}),
        resume(B),
        ?assertEqual({returned, b}, result_of(HeldCall))
    after
        resume(B)
    end,
    peer:stop(maps:get(peer, B)).

%% A call's own watcher (here by `{Name, Node}') ends with the call: the call
%% returned, timed out, or its caller was killed mid-call. No monitor of the
%% server from this node is left, and nothing in the caller's mailbox.
own_watcher_ends_with_call(Config) ->
    #{peer := Peer, node := Node, server := Srv} = setup(Config),
    Name = {gen_srv, Node},
    ?assertEqual(ok, convoy:call(Name, {echo, ok})),
    ?assertEqual({timeout, {gen_server, call, [Name, {late, 100}, 10]}},
                 exit_of(fun() -> convoy:call(Name, {late, 100}, 10) end)),
    receive {replied, Srv} -> ok after 5000 -> ct:fail(no_late_reply) end,
    ?assertEqual([], strays()),
    {Caller, Mon} = in_process(fun() -> convoy:call(Name, hold, infinity) end),
    receive {holding, Srv} -> ok after 10000 -> ct:fail(not_held) end,
    ?assertMatch([_], monitors_from_here(Peer, Srv)),
    exit(Caller, kill),
    receive {'DOWN', Mon, process, Caller, killed} -> ok end,
    convoy_ct_peers:await(fun() -> monitors_from_here(Peer, Srv) end,
                          fun(Ms) -> Ms =:= [] end, 5000).

%% A call to a node stopped with its connection full ends at its Timeout, by
%% `{Name, Node}' and by pid, and leaves nothing in the caller's mailbox.
call_to_stalled_node_times_out(Config) ->
    _ = setup(Config),
    B = #{node := Node, server := SrvB} = stalled_node(),
    try
        stall(B),
        [begin
             T0 = erlang:monotonic_time(millisecond),
             Caller = in_process(fun() ->
                                         {exit_of(fun() -> convoy:call(Ref, {echo, x}, 500) end),
                                          strays()}
                                 end),
             R = result_within(Caller, 5000),
             T = erlang:monotonic_time(millisecond) - T0,
             ct:pal("call to ~p on the stalled node: ~b ms", [Ref, T]),
             ?assertEqual({returned, {{timeout, {gen_server, call, [Ref, {echo, x}, 500]}}, []}},
                          R),
             ?assert(T >= 500 andalso T < 2000, {took, T})
         end || Ref <- [{gen_srv_b, Node}, SrvB]]
    after
        resume(B)
    end,
    peer:stop(maps:get(peer, B)).

%% A peer B running convoy (routed to through convoy from here) with a server
%% registered there as `gen_srv_b', owned by the calling process.
stalled_node() ->
    {Peer, Node} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(stalled_b), #{}),
    ok = convoy_ct_peers:start_convoy(Peer, #{}),
    convoy_ct_peers:await_route(Node, convoy),
    {ok, Srv} = peer:call(Peer, convoy_ct_server, start, [{local, gen_srv_b}, self()]),
    Sink = peer:call(Peer, erlang, spawn, [timer, sleep, [infinity]]),
    #{peer => Peer, node => Node, server => Srv, sink => Sink,
      os_pid => peer:call(Peer, os, getpid, [])}.

%% B's OS process stopped, then plain sends to it until the connection from here
%% is full: the socket takes no more (its port queues what the kernel refused)
%% and the connection is busy. It stays so until B runs again: from then on a
%% signal to B (a message, a monitor) suspends its sender.
stall(#{os_pid := OsPid, sink := Sink, node := Node}) ->
    _ = os:cmd("kill -STOP " ++ OsPid),
    {Node, Port} = lists:keyfind(Node, 1, erlang:system_info(dist_ctrl)),
    Deadline = erlang:monotonic_time(millisecond) + 30000,
    fill(Sink, binary:copy(<<"b">>, 1 bsl 20), Port, Deadline).

fill(Sink, Big, Port, Deadline) ->
    case erlang:send(Sink, Big, [nosuspend]) of
        ok ->
            fill(Sink, Big, Port, Deadline);
        nosuspend ->
            case erlang:port_info(Port, queue_size) of
                {queue_size, Q} when Q > 0 ->
                    ok;
                _ ->
                    %% Busy for now, but the socket still takes what is queued.
                    erlang:monotonic_time(millisecond) < Deadline
                        orelse ct:fail(connection_never_full),
                    receive after 10 -> fill(Sink, Big, Port, Deadline) end
            end
    end.

resume(#{os_pid := OsPid}) ->
    _ = os:cmd("kill -CONT " ++ OsPid),
    ok.

%% The caller is past convoy_calls:watch/2 (its cast to convoy_calls is sent):
%% waiting, or suspended on the stalled connection.
past_watch({Pid, _}) ->
    convoy_ct_peers:await(fun() -> process_info(Pid, status) end,
                          fun(St) -> lists:member(St, [{status, waiting}, {status, suspended}])
                          end, 10000).

%% The processes linked to convoy_calls (its watchers) that are suspended.
suspended_watchers(Helper) ->
    {links, Links} = process_info(Helper, links),
    [W || W <- Links, process_info(W, status) =:= {status, suspended}].

%% What in_process/1 ran returned, or a failure if it has not within Ms.
result_within({Pid, Mon}, Ms) ->
    receive {result, Pid, R} -> demonitor(Mon, [flush]), R
    after Ms -> ct:fail({no_result_within, Ms})
    end.

%% A server nobody calls any more is no longer monitored (within two sweeps),
%% also when a caller was killed in the middle of its call (its entry is swept).
idle_monitors_dropped(Config) ->
    #{peer := Peer, server := Srv} = setup(Config),
    await_watched(Srv),
    %% gen_server:call's own monitor goes asynchronously (its demonitor travels
    %% the connection; peer:call does not wait behind it).
    convoy_ct_peers:await(fun() -> monitors_from_here(Peer, Srv) end,
                          fun shared_monitor/1, 5000),
    {Killed, KilledMon} = in_process(fun() -> convoy:call(Srv, hold, infinity) end),
    receive {holding, Srv} -> ok after 10000 -> ct:fail(not_held) end,
    exit(Killed, kill),
    receive {'DOWN', KilledMon, process, Killed, killed} -> ok end,
    ?assertMatch([_], ets:tab2list(convoy_call_waiters)),
    convoy_ct_peers:await(fun() -> monitors_from_here(Peer, Srv) end,
                          fun(Ms) -> Ms =:= [] end, 15000),
    ?assertEqual([], ets:tab2list(convoy_call_watched)),
    ?assertEqual([], ets:tab2list(convoy_call_waiters)),
    ?assertEqual(1, convoy:call(Srv, {echo, 1})).

%% A watcher of convoy_calls killed from elsewhere is replaced: the server stays
%% watched, and a caller relying on it still exits with the server's reason.
calls_watcher_killed(Config) ->
    #{peer := Peer, server := Srv} = setup(Config),
    await_watched(Srv),
    [W] = convoy_ct_peers:await(fun() -> monitors_from_here(Peer, Srv) end,
                                fun shared_monitor/1, 5000),
    Rejected = maps:get(unknown_message, convoy_metrics:rejected(), 0),
    Caller = in_process(fun() -> convoy:call(Srv, hold, infinity) end),
    receive {holding, Srv} -> ok after 10000 -> ct:fail(not_held) end,
    ?assertMatch([_], ets:match(convoy_call_waiters, {'_', Srv, '_'})),
    exit(W, kill),
    convoy_ct_peers:await(fun() -> monitors_from_here(Peer, Srv) end,
                          fun(Ms) -> shared_monitor(Ms) andalso Ms =/= [W] end, 5000),
    ?assert(ets:member(convoy_call_watched, Srv)),
    exit(Srv, boom),
    ?assertEqual({boom, {gen_server, call, [Srv, hold, infinity]}}, result_of(Caller)),
    ?assertEqual(Rejected, maps:get(unknown_message, convoy_metrics:rejected(), 0)).

%% Stray, malformed and misdirected input to convoy_calls is counted and changes
%% nothing.
calls_helper_rejects_strays(Config) ->
    #{server := Srv} = setup(Config),
    Helper = whereis(convoy_calls),
    Before = maps:get(unknown_message, convoy_metrics:rejected(), 0),
    ?assertEqual({error, badarg}, gen_server:call(Helper, junk)),
    gen_server:cast(Helper, {watch, self()}), % local
    gen_server:cast(Helper, {watch, {"x", node(Srv)}}),
    gen_server:cast(Helper, junk),
    Helper ! {'DOWN', make_ref(), process, Srv, forged},
    Helper ! {'EXIT', self(), forged}, % not one of its watchers
    Helper ! {'$convoy_calls_watching', self()},
    Helper ! junk,
    _ = sys:get_state(Helper),
    ?assertEqual(Before + 8, maps:get(unknown_message, convoy_metrics:rejected(), 0)),
    ?assertEqual(Helper, whereis(convoy_calls)),
    ?assertEqual(3, convoy:call(Srv, {echo, 3})).

%% Messages that look like convoy_calls' sweep timer are counted as rejected and
%% start no sweep (the work of one is forget_dead_callers/0, counted here): were
%% they taken, each would arm one more sweep timer, for good.
calls_helper_rejects_stray_sweeps(_Config) ->
    start_convoy(#{}),
    Helper = whereis(convoy_calls),
    Before = maps:get(unknown_message, convoy_metrics:rejected(), 0),
    Sweep = {convoy_calls, forget_dead_callers, 0},
    1 = erlang:trace_pattern(Sweep, true, [call_count]),
    try
        Strays = [sweep, {timeout, make_ref(), sweep}],
        [Helper ! M || _ <- lists:seq(1, 1000), M <- Strays],
        _ = sys:get_state(Helper),
        %% Its own timer may have gone off once meanwhile.
        {call_count, Sweeps} = erlang:trace_info(Sweep, call_count),
        ?assert(Sweeps =< 1, {sweeps, Sweeps}),
        ?assertEqual(Before + 2000, maps:get(unknown_message, convoy_metrics:rejected(), 0))
    after
        erlang:trace_pattern(Sweep, false, [call_count])
    end,
    ?assertEqual(Helper, whereis(convoy_calls)).

%% The server's node is killed (SIGKILL) while it holds calls made by every form:
%% nodedown by pid and `{Name, Node}', noproc by global and via names (as gen
%% does); gen_server:call and convoy:call exit alike.
node_killed_mid_call(Config) ->
    #{peer := Peer, node := Node, forms := Forms} = setup(Config),
    Callers = [{F, [in_process(fun() -> M:call(F, hold, 20000) end)
                    || M <- [gen_server, convoy]]} || F <- Forms],
    [receive {holding, _} -> ok after 10000 -> ct:fail(not_held) end || _ <- lists:seq(1, 8)],
    os:cmd("kill -KILL " ++ peer:call(Peer, os, getpid, [])),
    catch peer:stop(Peer),
    [begin
         [Gen, Convoy] = [result_of(C) || C <- Cs],
         Reason = case F of
                      {global, _} -> noproc;
                      {via, _, _} -> noproc;
                      _ -> {nodedown, Node}
                  end,
         ?assertEqual({Reason, {gen_server, call, [F, hold, 20000]}}, Gen),
         ?assertEqual(Gen, Convoy)
     end || {F, Cs} <- Callers],
    %% A via name still naming a process of the dead node: noproc, as gen does.
    Via = lists:last(Forms),
    same_exit({noproc, {gen_server, call, [Via, x, 3000]}},
              fun(M) -> M:call(Via, x, 3000) end).

%% send/2, cast/2 and call/2 from one process to one server arrive in the order
%% made (four such processes at once, so that convoy batches).
order_send_cast_call(Config) ->
    S = #{server := Srv} = setup(Config),
    B = before(S),
    N = 2000,
    Self = self(),
    Senders = [spawn_link(fun() -> Self ! {sent, self(), mixed(Srv, K, N)} end)
               || K <- lists:seq(1, 4)],
    Sent = [receive {sent, P, Kinds} -> {K, Kinds} after 120000 -> ct:fail(stuck) end
            || {K, P} <- lists:zip(lists:seq(1, 4), Senders)],
    Log = convoy:call(Srv, log),
    [begin
         Mine = [{Kind, I} || {Kind, {seq, {K1, I}}} <- Log, K1 =:= K],
         ?assertEqual(lists:zip(Kinds, lists:seq(1, N)), Mine)
     end || {K, Kinds} <- Sent],
    went_through(S, B, 4 * N).

%% N requests {seq, {K, I}} to Srv, each a send, a cast or (1 in 20) a call;
%% returns the kinds in order, as the server logs them, once the server has
%% them all (a last call, behind them).
mixed(Srv, K, N) ->
    rand:seed(exsss, {K, 3, 5}),
    Kinds = [case rand:uniform(20) of
                 1 -> ok = convoy:call(Srv, {seq, {K, I}}), call;
                 X when X =< 10 -> ok = convoy:send(Srv, {seq, {K, I}}), info;
                 _ -> ok = convoy:cast(Srv, {seq, {K, I}}), cast
             end || I <- lists:seq(1, N)],
    done = convoy:call(Srv, {echo, done}),
    Kinds.

%% 200 callers at once, 20 calls each: every caller gets its own answers and
%% nothing else.
concurrent_callers(Config) ->
    S = #{server := Srv} = setup(Config),
    B = before(S),
    Self = self(),
    Callers = [spawn_link(fun() ->
                                  Ok = [convoy:call(Srv, {echo, {self(), J}}) =:= {self(), J}
                                        || J <- lists:seq(1, 20)],
                                  Self ! {done, self(), lists:all(fun(X) -> X end, Ok),
                                          strays()}
                          end) || _ <- lists:seq(1, 200)],
    [receive {done, C, AllOk, Strays} ->
             ?assert(AllOk),
             ?assertEqual([], Strays)
     after 120000 -> ct:fail({caller_stuck, C})
     end || C <- Callers],
    went_through(S, B, 200 * 20).

%%--------------------------------------------------------------------
%% convoy_peer only

%% Malformed references and timeouts raise or exit as gen_server does (stack
%% traces aside); casts to a malformed reference raise the same error.
malformed_like_gen_server(Config) ->
    Srv = case ?config(situation, Config) of
              local -> start_convoy(#{}),
                       {ok, P} = convoy_ct_server:start(self()),
                       P;
              _ -> maps:get(server, setup(Config))
          end,
    Refs = ["bad", 42, {1, 2}, {a, b, c}, {via, nosuch_module_xyz, n}, {global}],
    [begin
         ?assertEqual(raised(fun() -> gen_server:cast(R, x) end),
                      raised(fun() -> convoy:cast(R, x) end)),
         ?assertEqual(no_stack(exit_of(fun() -> gen_server:call(R, x) end)),
                      no_stack(exit_of(fun() -> convoy:call(R, x) end))),
         ?assertEqual(no_stack(exit_of(fun() -> gen_server:call(R, x, 100) end)),
                      no_stack(exit_of(fun() -> convoy:call(R, x, 100) end)))
     end || R <- Refs],
    [?assertEqual(no_stack(exit_of(fun() -> gen_server:call(Srv, x, T) end)),
                  no_stack(exit_of(fun() -> convoy:call(Srv, x, T) end)))
     || T <- [-1, foo, 1.5]],
    ?assertEqual([], strays()).

raised(Fun) ->
    try Fun() of
        V -> {returned, V}
    catch
        C:E -> {C, E}
    end.

no_stack({{Error, Stack}, {gen_server, call, Args}}) when is_list(Stack) ->
    {{Error, stack}, {gen_server, call, Args}};
no_stack(Other) ->
    Other.

%% A call to a node whose bound is reached waits for room within its timeout,
%% whatever the overload policy (here `error', which refuses a send at once).
%% The bound is reached without stalling the node (whose distribution buffer
%% would hold the caller in erlang:monitor/3, as it holds gen_server:call):
%% `max_delay' keeps messages in the lane for 10 s unless a flush ships them.
call_waits_for_room(Config) ->
    #{node := Node, server := Srv} =
        setup(Config, #{overload => error, max_delay => 10000000, max_buffered => 5}),
    Sink = spawn(Node, fun S() -> receive _ -> S() end end),
    [ok = convoy:send(Sink, fill) || _ <- lists:seq(1, 5)],
    ?assertEqual({error, overload}, convoy:send(Sink, x, #{overload => error})),
    #{refused := R0} = maps:get(Node, maps:get(nodes, convoy:info())),
    %% No room within 200 ms: timeout (the request never left), counted as refused.
    T0 = erlang:monotonic_time(millisecond),
    ?assertEqual({timeout, {gen_server, call, [Srv, {echo, x}, 200]}},
                 exit_of(fun() -> convoy:call(Srv, {echo, x}, 200) end)),
    ?assert(erlang:monotonic_time(millisecond) - T0 >= 200),
    ?assertEqual([], strays()),
    #{refused := R1} = maps:get(Node, maps:get(nodes, convoy:info())),
    ?assertEqual(R0 + 1, R1),
    %% A call with time to spare waits for room (not refused at once as `error'
    %% would) and gets its answer once flushes ship the queue and its request.
    Caller = {Pid, _} = in_process(fun() -> convoy:call(Srv, {echo, made_it}, 60000) end),
    convoy_ct_peers:await(fun() -> waits_for_room(Pid) end, fun(W) -> W end, 10000),
    ?assertEqual({returned, made_it}, flush_until(Node, Caller)),
    #{refused := R1} = maps:get(Node, maps:get(nodes, convoy:info())).

%% The process is blocked in convoy_wait waiting for room.
waits_for_room(Pid) ->
    {current_stacktrace, Stack} = process_info(Pid, current_stacktrace),
    lists:any(fun({convoy_wait, F, _, _}) -> F =:= room_loop;
                 (_) -> false
              end, Stack).

flush_until(Node, Caller = {Pid, Mon}) ->
    ok = convoy:flush(Node),
    receive
        {result, Pid, R} -> demonitor(Mon, [flush]), R
    after 50 ->
        flush_until(Node, Caller)
    end.

%%--------------------------------------------------------------------
%% local

%% A server on this node: every form works, and exits are gen_server's.
local_forms(_Config) ->
    start_convoy(#{}),
    {ok, Srv} = convoy_ct_server:start({local, gen_local}, self()),
    Global = {gen_local_global, erlang:unique_integer()},
    yes = global:register_name(Global, Srv),
    yes = convoy_ct_server:register_name(local_via, Srv),
    Forms = [Srv, gen_local, {gen_local, node()}, {global, Global},
             {via, convoy_ct_server, local_via}],
    [begin
         ok = convoy:cast(F, {hello, F}),
         ?assertEqual(F, convoy:call(F, {echo, F})),
         ?assertEqual(F, convoy:call(F, {echo, F}, 1000))
     end || F <- Forms],
    ?assertEqual([{cast, {hello, F}} || F <- Forms], convoy:call(Srv, log)),
    Self = self(),
    same_exit({calling_self, {gen_server, call, [Self, x, 100]}},
              fun(M) -> M:call(Self, x, 100) end),
    same_exit({noproc, {gen_server, call, [nosuch_local, x]}},
              fun(M) -> M:call(nosuch_local, x) end),
    same_exit({noproc, {gen_server, call, [{nosuch_local, node()}, x]}},
              fun(M) -> M:call({nosuch_local, node()}, x) end),
    same_exit({timeout, {gen_server, call, [Srv, {late, 200}, 20]}},
              fun(M) -> M:call(Srv, {late, 200}, 20) end),
    [receive {replied, Srv} -> ok after 5000 -> ct:fail(no_reply) end || _ <- [1, 2]],
    ?assertEqual([], strays()),
    ok = convoy_ct_server:unregister_name(local_via),
    gen_server:stop(Srv).
