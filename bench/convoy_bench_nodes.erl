%% The nodes the harness measures on. The harness node only coordinates: every
%% cross-node measurement runs between nodes A (driver) and B (sink), and C (a
%% second sink) for fan-out. Each "family" is its own set of nodes, because the
%% distribution flags that define some variants are settings of both ends:
%%
%% <ul>
%% <li>`default': plain emulator flags; used by `local', `plain' and every convoy
%%   variant (convoy is stopped for the plain ones and restarted with each convoy
%%   variant's settings on all nodes of the family);</li>
%% <li>`nodelay_false': `-kernel dist_nodelay false' on every node;</li>
%% <li>`delay_send': `{delay_send, true}' in the distribution's connect and listen
%%   options on every node.</li>
%% </ul>
%%
%% Nodes are OTP `peer' nodes started on first use (connected over distribution,
%% with convoy's and the harness's code paths), or, with `--nodes', nodes the user
%% started (then only the `default' family exists).
%%
%% `reset/2' makes a family's nodes clean after a measurement was abandoned at its
%% deadline: peers are stopped (the next `prepare/4' starts new ones, under new
%% names); on given nodes every process of the measurement is killed and convoy is
%% restarted by the next `prepare/4'.
-module(convoy_bench_nodes).

-export([new/1, families/0, family_flags/1, available/3, prepare/4, reset/2, settle/1,
         stop/1, facts/1, drain/1]).
%% Called on given nodes by reset/2.
-export([kill_measurements/0]).

-type family() :: default | nodelay_false | delay_send.
-type convoy_setting() :: off | map().
-type state() :: #{given := [node()] | none,
                   peer_args := [string()],
                   generation := non_neg_integer(),
                   families := #{family() => #{nodes := [node()],
                                               peers := [pid()],
                                               convoy := convoy_setting() | unknown}}}.
-export_type([family/0, state/0, convoy_setting/0]).

-define(ROUTE_WAIT_MS, 10000).
-define(CONNECT_WAIT_MS, 30000).
%% settle/1: polls this far apart, until this many polls in a row find nothing
%% waiting to run, for at most SETTLE_MS.
-define(SETTLE_POLL_MS, 10).
-define(SETTLE_QUIET_POLLS, 3).
-define(SETTLE_MS, 10000).
%% Before convoy stops: how often to look at what it still holds, and how long
%% without progress before stopping it anyway.
-define(DRAIN_POLL_MS, 200).
-define(DRAIN_STALL_MS, 10000).

%% @doc A fresh state. `Given' is `none' (start peers) or the user's nodes.
-spec new(#{given := [node()] | none, peer_args := [string()]}) -> state().
new(#{given := Given, peer_args := PeerArgs}) ->
    #{given => Given, peer_args => PeerArgs, generation => 0, families => #{}}.

-spec families() -> [family()].
families() -> [default, nodelay_false, delay_send].

%% @doc Emulator flags that define a family (given to every node of it).
-spec family_flags(family()) -> [string()].
family_flags(default) ->
    [];
family_flags(nodelay_false) ->
    ["-kernel", "dist_nodelay", "false"];
family_flags(delay_send) ->
    ["-kernel", "inet_dist_connect_options", "[{delay_send,true}]",
     "-kernel", "inet_dist_listen_options", "[{delay_send,true}]"].

%% @doc Whether `Family' can provide `Count' nodes: always with peers; with given
%% nodes only the `default' family, and only if enough nodes were given.
-spec available(family(), pos_integer(), state()) -> true | {false, binary()}.
available(_Family, _Count, #{given := none}) ->
    true;
available(default, Count, #{given := Given}) when length(Given) >= Count ->
    true;
available(default, Count, #{given := Given}) ->
    {false, iolist_to_binary(io_lib:format("needs ~b nodes, --nodes gave ~b",
                                           [Count, length(Given)]))};
available(Family, _Count, #{given := _}) ->
    {false, iolist_to_binary(io_lib:format("needs nodes started with ~s; not available "
                                           "with --nodes/--netns",
                                           [lists:join(" ", family_flags(Family))]))}.

%% @doc The first `Count' nodes of `Family', started and connected if needed, with
%% convoy running with `Convoy' settings (or stopped, `off') on all of them.
-spec prepare(family(), 2 | 3, convoy_setting(), state()) -> {[node()], state()}.
prepare(Family, Count, Convoy, State0) ->
    State1 = ensure_nodes(Family, Count, State0),
    #{families := #{Family := F = #{nodes := All}}} = State1,
    Nodes = lists:sublist(All, Count),
    case maps:get(convoy, F) of
        Convoy ->
            {Nodes, State1};
        _ ->
            ok = set_convoy(All, Convoy),
            {Nodes, put_family(Family, F#{convoy => Convoy}, State1)}
    end.

%% @doc Leave no trace of an abandoned measurement on `Family''s nodes: stop its
%% peers (the next `prepare/4' starts fresh ones) or, on given nodes, kill every
%% process the measurement spawned and have the next `prepare/4' restart convoy.
-spec reset(family(), state()) -> state().
reset(Family, S = #{given := none, families := Fs, generation := G}) ->
    case Fs of
        #{Family := #{peers := Ps}} ->
            _ = [catch peer:stop(P) || P <- Ps],
            S#{families := maps:remove(Family, Fs), generation := G + 1};
        _ ->
            S
    end;
reset(Family, S = #{families := Fs}) ->
    case Fs of
        #{Family := F = #{nodes := Ns}} ->
            _ = [catch erpc:call(N, ?MODULE, kill_measurements, [], 10000) || N <- Ns],
            put_family(Family, F#{convoy := unknown}, S);
        _ ->
            S
    end.

%% @doc Wait until no node of any family, nor this one, has anything waiting to
%% run (`total_run_queue_lengths_all' 0 at `SETTLE_QUIET_POLLS' polls in a row),
%% for at most `SETTLE_MS'; returns the milliseconds waited. All families' nodes
%% share the machine's cores, and what a measurement leaves behind (its processes
%% exiting, 10,000 `pg' members leaving, garbage collection) must not run during
%% the next variant's: with the variants interleaved point by point, it would
%% land on whichever variant comes next.
-spec settle(state()) -> non_neg_integer().
settle(#{families := Fs}) ->
    Nodes = [N || #{nodes := Ns} <- maps:values(Fs), N <- Ns, N =/= node()],
    T0 = erlang:monotonic_time(millisecond),
    settle(Nodes, T0 + ?SETTLE_MS, 0),
    erlang:monotonic_time(millisecond) - T0.

settle(_Nodes, _Deadline, ?SETTLE_QUIET_POLLS) ->
    ok;
settle(Nodes, Deadline, Quiet) ->
    case erlang:monotonic_time(millisecond) >= Deadline of
        true ->
            ok;
        false ->
            Waiting = lists:sum([waiting_to_run(N) || N <- [node() | Nodes]]),
            timer:sleep(?SETTLE_POLL_MS),
            settle(Nodes, Deadline, case Waiting of
                                        0 -> Quiet + 1;
                                        _ -> 0
                                    end)
    end.

%% A node that does not answer has nothing to settle (a later step reports it).
waiting_to_run(Node) when Node =:= node() ->
    erlang:statistics(total_run_queue_lengths_all);
waiting_to_run(Node) ->
    try erpc:call(Node, erlang, statistics, [total_run_queue_lengths_all], 5000)
    catch _:_ -> 0
    end.

%% @doc Kill every process on this node that runs the harness's measuring code
%% (spawned with a function of one of its modules, `convoy_bench_measure' or a
%% scenario's own: `convoy_bench_fanout', `convoy_bench_flow', ...) and wait until
%% they are gone; returns how many.
-spec kill_measurements() -> non_neg_integer().
kill_measurements() ->
    Victims = [P || P <- processes(), P =/= self(),
                    {initial_call, {M, _, _}} <- [erlang:process_info(P, initial_call)],
                    lists:prefix("convoy_bench_", atom_to_list(M))],
    Mons = [{P, monitor(process, P)} || P <- Victims],
    [exit(P, kill) || P <- Victims],
    %% Dead before we answer: a registered sink's name is free again.
    [receive {'DOWN', M, process, P, _} -> ok after 5000 -> ok end || {P, M} <- Mons],
    length(Victims).

%% @doc Stop the peers this harness started (given nodes: stop convoy there).
-spec stop(state()) -> ok.
stop(#{given := none, families := Fs}) ->
    [catch peer:stop(P) || #{peers := Ps} <- maps:values(Fs), P <- Ps],
    ok;
stop(#{families := Fs}) ->
    [catch erpc:call(N, application, stop, [convoy]) || #{nodes := Ns} <- maps:values(Fs),
                                                       N <- Ns],
    ok.

%% @doc What the report prints about a node: OTP, schedulers, cores, flags.
-spec facts(node()) -> map().
facts(Node) ->
    Info = fun(K) -> erpc:call(Node, erlang, system_info, [K]) end,
    {ok, Host} = erpc:call(Node, inet, gethostname, []),
    #{node => Node,
      host => list_to_binary(Host),
      otp_release => list_to_binary(Info(otp_release)),
      erts_version => list_to_binary(Info(version)),
      schedulers => Info(schedulers),
      schedulers_online => Info(schedulers_online),
      logical_processors => Info(logical_processors),
      logical_processors_available => unknown_to_null(Info(logical_processors_available)),
      dist_nodelay => erpc:call(Node, application, get_env, [kernel, dist_nodelay, true]),
      convoy_defaults => erpc:call(Node, convoy_config, defaults, []),
      cpu_model => proc_line(Node, "/proc/cpuinfo", "model name"),
      memory_gib => memory_gib(proc_line(Node, "/proc/meminfo", "MemTotal")),
      os => os_name(Node)}.

%% The value of the first `Key: value' line of a /proc file on Node, or null
%% (not Linux).
proc_line(Node, File, Key) ->
    case erpc:call(Node, file, read_file, [File]) of
        {ok, Text} ->
            Lines = binary:split(Text, <<"\n">>, [global]),
            case [string:trim(V) || L <- Lines, [K, V] <- [binary:split(L, <<":">>)],
                                    string:trim(K) =:= list_to_binary(Key)] of
                [V | _] -> V;
                [] -> null
            end;
        {error, _} ->
            null
    end.

memory_gib(null) -> null;
memory_gib(KB) ->
    case string:to_integer(KB) of
        {N, _} when is_integer(N) -> round(N / 1048576 * 10) / 10;
        _ -> null
    end.

%% PRETTY_NAME of /etc/os-release on Node, or null.
os_name(Node) ->
    case erpc:call(Node, file, read_file, ["/etc/os-release"]) of
        {ok, Text} ->
            case [V || L <- binary:split(Text, <<"\n">>, [global]),
                       <<"PRETTY_NAME=", V/binary>> <- [L]] of
                [V | _] -> string:trim(V, both, "\"");
                [] -> null
            end;
        {error, _} ->
            null
    end.

unknown_to_null(unknown) -> null;
unknown_to_null(N) -> N.

%%--------------------------------------------------------------------

put_family(Family, F, S = #{families := Fs}) ->
    S#{families := Fs#{Family => F}}.

ensure_nodes(Family, Count, S = #{families := Fs}) ->
    Have = case Fs of
               #{Family := #{nodes := Ns}} -> length(Ns);
               _ -> 0
           end,
    case Have >= Count of
        true -> S;
        false -> add_nodes(Family, Count, S)
    end.

add_nodes(default, Count, S = #{given := Given}) when Given =/= none ->
    length(Given) >= Count orelse
        error({not_enough_nodes, Count, Given}),
    Deadline = erlang:monotonic_time(millisecond) + ?CONNECT_WAIT_MS,
    [await_connect(N, Deadline) || N <- Given],
    [load_code(N) || N <- Given],
    connect_all(Given),
    put_family(default, #{nodes => Given, peers => [], convoy => unknown}, S);
add_nodes(Family, Count, S = #{families := Fs, peer_args := Extra, generation := G}) ->
    F0 = maps:get(Family, Fs, #{nodes => [], peers => [], convoy => unknown}),
    #{nodes := Ns0, peers := Ps0} = F0,
    New = [start_peer(Family, I, G, Extra) || I <- lists:seq(length(Ns0) + 1, Count)],
    Ns = Ns0 ++ [N || {_, N} <- New],
    connect_all(Ns),
    %% A new node has no convoy: force the next prepare/4 to set it everywhere.
    put_family(Family, F0#{nodes := Ns, peers := Ps0 ++ [P || {P, _} <- New],
                           convoy := unknown}, S).

%% Nodes started after a reset/2 (generation G > 0) get new names: the old ones
%% may not have left epmd yet.
start_peer(Family, I, G, Extra) ->
    Name = list_to_atom(lists:flatten(io_lib:format("convoy_bench_~s_~c_~s~s",
                                                    [Family, $a + I - 1, os:getpid(),
                                                     [["_", integer_to_list(G)] || G > 0]]))),
    Args = ["-pa", code_dir(convoy), "-pa", code_dir(?MODULE),
            "+P", "2000000",
            %% Families must not meet: no transitive connections through global.
            "-connect_all", "false",
            %% Quiet about convoy being stopped and started between variants.
            "-kernel", "logger_level", "warning"] ++ family_flags(Family) ++ Extra,
    {ok, Pid, Node} = peer:start_link(#{name => Name, args => Args, wait_boot => 60000}),
    {Pid, Node}.

%% Given nodes may still be booting (bin/convoy-bench --netns starts them).
await_connect(Node, Deadline) ->
    case net_kernel:connect_node(Node) of
        true -> ok;
        _ ->
            erlang:monotonic_time(millisecond) < Deadline orelse
                error({cannot_connect, Node, erlang:get_cookie()}),
            receive after 200 -> await_connect(Node, Deadline) end
    end.

code_dir(Module) ->
    filename:dirname(code:which(Module)).

connect_all(Nodes) ->
    [true = erpc:call(A, net_kernel, connect_node, [B]) || A <- Nodes, B <- Nodes, A < B],
    ok.

%% The harness's modules are always pushed to given nodes (they are its own code);
%% convoy only when the node cannot load it itself.
load_code(Node) ->
    [push_module(Node, M) || M <- bench_modules()],
    case erpc:call(Node, code, which, [convoy]) of
        non_existing -> push_convoy(Node);
        _ -> ok
    end.

bench_modules() ->
    Dir = code_dir(?MODULE),
    [list_to_atom(filename:basename(F, ".beam"))
     || F <- filelib:wildcard(filename:join(Dir, "convoy_bench*.beam"))].

push_module(Node, M) ->
    {M, Bin, File} = code:get_object_code(M),
    {module, M} = erpc:call(Node, code, load_binary, [M, File, Bin]).

push_convoy(Node) ->
    _ = application:load(convoy),
    {ok, Mods} = application:get_key(convoy, modules),
    [push_module(Node, M) || M <- Mods],
    AppFile = filename:join(code:lib_dir(convoy, ebin), "convoy.app"),
    {ok, [{application, convoy, Props}]} = file:consult(AppFile),
    case erpc:call(Node, application, load, [{application, convoy, Props}]) of
        ok -> ok;
        {error, {already_loaded, convoy}} -> ok
    end.

%% Stop convoy on every node, then start it with the wanted settings and wait until
%% each node routes to every other through convoy.
set_convoy(Nodes, Wanted) ->
    ok = drain(Nodes),
    ok = say_compressed(Nodes),
    [case erpc:call(N, application, stop, [convoy]) of
         ok -> ok;
         {error, {not_started, convoy}} -> ok
     end || N <- Nodes],
    case Wanted of
        off ->
            ok;
        Settings ->
            [start_convoy(N, Settings) || N <- Nodes],
            await_routes(Nodes, erlang:monotonic_time(millisecond) + ?ROUTE_WAIT_MS)
    end.

%% What convoy still holds on Nodes for their peers ships before it stops: on a
%% slow link that takes as long as the link needs, where convoy's own drain at
%% stop is bounded (10 s) and would drop the rest. Waits while the count goes
%% down, says what it waits for, and stops waiting after ?DRAIN_STALL_MS without
%% progress (a peer that takes nothing).
-spec drain([node()]) -> ok.
drain(Nodes) ->
    case held(Nodes) of
        0 ->
            ok;
        Held ->
            io:format(standard_error, "convoy-bench: waiting for convoy to ship ~b messages "
                      "still held for its peers before it stops~n", [Held]),
            T0 = erlang:monotonic_time(millisecond),
            Left = drain(Nodes, Held, T0),
            io:format(standard_error, "convoy-bench: ~s after ~.1f s~n",
                      [case Left of
                           0 -> "shipped";
                           _ -> io_lib:format("~b still held, no progress: stopping anyway",
                                              [Left])
                       end, (erlang:monotonic_time(millisecond) - T0) / 1000]),
            ok
    end.

drain(Nodes, Held, Since) ->
    timer:sleep(?DRAIN_POLL_MS),
    Now = erlang:monotonic_time(millisecond),
    case held(Nodes) of
        0 -> 0;
        Less when Less < Held -> drain(Nodes, Less, Now);
        Same when Now - Since >= ?DRAIN_STALL_MS -> Same;
        Same -> drain(Nodes, Same, Since)
    end.

%% What the convoy that is about to stop compressed (`compress' set) since it
%% started, in the cells just measured with its settings, so that a cell of
%% `auto' can be read with what it did; nothing said when it compressed nothing.
say_compressed(Nodes) ->
    Counts = [Counts || N <- Nodes,
                        #{nodes := PerNode} <- [catch erpc:call(N, convoy, info, [], 5000)],
                        Counts <- maps:values(PerNode)],
    Sum = fun(K) -> lists:sum([maps:get(K, C, 0) || C <- Counts]) end,
    case Sum(compressed_batches) of
        0 ->
            ok;
        Zipped ->
            io:format(standard_error, "convoy-bench: convoy sent ~b of its ~b batches "
                      "compressed since it started (~.1f MB in, ~.1f MB out)~n",
                      [Zipped, Sum(batches), Sum(compressed_bytes_in) / 1.0e6,
                       Sum(compressed_bytes_out) / 1.0e6])
    end.

%% Messages convoy holds on Nodes (room taken for them until their lane ships
%% them: in its mailbox or its queues).
held(Nodes) ->
    lists:sum([maps:get(queued, Counts, 0)
               || N <- Nodes,
                  #{nodes := PerNode} <- [catch erpc:call(N, convoy, info, [], 5000)],
                  Counts <- maps:values(PerNode)]).

start_convoy(Node, Settings) ->
    [ok = erpc:call(Node, application, unset_env, [convoy, K])
     || K <- erpc:call(Node, convoy_config, keys, [])],
    [ok = erpc:call(Node, application, set_env, [convoy, K, V])
     || {K, V} <- maps:to_list(Settings)],
    {ok, _} = erpc:call(Node, application, ensure_all_started, [convoy]),
    ok.

await_routes(Nodes, Deadline) ->
    Missing = [{N, O} || N <- Nodes,
                         Routes <- [erpc:call(N, convoy, info, [])],
                         O <- Nodes, O =/= N,
                         not routes_convoy(O, Routes)],
    case Missing of
        [] ->
            ok;
        _ ->
            erlang:monotonic_time(millisecond) < Deadline orelse
                error({convoy_routes_not_ready, Missing}),
            receive after 10 -> await_routes(Nodes, Deadline) end
    end.

routes_convoy(Other, #{nodes := Ns}) ->
    case Ns of
        #{Other := #{route := convoy}} -> true;
        _ -> false
    end.
