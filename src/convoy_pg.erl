%% @private
%% What convoy reads of OTP's `pg': a group's members on one node as this node
%% sees them, and a scope's local members where a publish entry is delivered.
%% Reads ETS only (as `pg:get_members/2' does), never calls the scope process.
%%
%% A scope is a process registered under the scope's name that owns the ETS table
%% of that name (`pg' creates it so). A name that is not such a scope here is
%% `no_scope': a publish entry that names it is counted as `undeliverable' by the
%% inbox, as a send to a registered name nobody holds is.
-module(convoy_pg).

-export([split/1, members_on/3, local_members/2]).

%% @doc Members split into this node's (in `pg''s order) and the other nodes that
%% have members (each once). One pass with no allocation per remote member: `pg'
%% lists a node's members together (they join in batches), so a member is nearly
%% always on the node of the one before it, and the list of nodes stays short.
-spec split([pid()]) -> {[pid()], [node()]}.
split(Members) ->
    split(Members, node(), node(), [], []).

split([P | Ps], Local, Last, Here, Nodes) ->
    case node(P) of
        Last when Last =/= Local -> split(Ps, Local, Last, Here, Nodes);
        Local -> split(Ps, Local, Local, [P | Here], Nodes);
        N ->
            case lists:member(N, Nodes) of
                true -> split(Ps, Local, N, Here, Nodes);
                false -> split(Ps, Local, N, Here, [N | Nodes])
            end
    end;
split([], _Local, _Last, Here, Nodes) ->
    {lists:reverse(Here), lists:reverse(Nodes)}.

%% @doc The members of `Group' in `Scope' that run on `Node', as this node sees
%% them now (`[]' when the scope does not run here).
-spec members_on(atom(), term(), node()) -> [pid()].
members_on(Scope, Group, Node) ->
    [P || P <- pg:get_members(Scope, Group), node(P) =:= Node].

%% @doc This node's members of `Group' in `Scope' now, or `no_scope'. Read as
%% `pg:get_local_members/2' reads them (the third element of the group's row), but
%% a table that is not `pg''s after all is `no_scope' rather than a non-list.
-spec local_members(atom(), term()) -> {ok, list()} | no_scope.
local_members(Scope, Group) ->
    case is_scope(Scope) of
        true ->
            try ets:lookup_element(Scope, Group, 3) of
                L when is_list(L) -> {ok, L};
                _ -> no_scope
            catch
                error:badarg -> {ok, []} % no such group here
            end;
        false ->
            no_scope
    end.

is_scope(Scope) ->
    case whereis(Scope) of
        undefined -> false;
        Pid -> ets:info(Scope, owner) =:= Pid
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% A pid of Node, as it would arrive from there.
pid_of(Node, Id) ->
    N = atom_to_binary(Node, utf8),
    binary_to_term(<<131, 88, 119, (byte_size(N)), N/binary, Id:32, 0:32, 1:32>>).

split_test() ->
    [B1, B2, B3] = [pid_of(b@h, I) || I <- [1, 2, 3]],
    [C1, C2] = [pid_of(c@h, I) || I <- [1, 2]],
    Me = self(),
    Other = spawn(fun() -> ok end),
    ?assertEqual({[], []}, split([])),
    ?assertEqual({[Me, Other], []}, split([Me, Other])),
    %% local members in pg's order, every other node once, in the order first seen
    ?assertEqual({[Me, Other], [b@h, c@h]}, split([B1, Me, B2, C1, B3, Other, C2, B1])),
    ?assertEqual({[], [c@h, b@h]}, split([C1, B1, C2, B2])).
-endif.
